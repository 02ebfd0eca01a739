"""The experience buffer on Delta Lake: schema, validated writer, batch pinning, reader.

Importing this package does not import torch (`reader.to_tensors` imports it when called).
"""

from trinity_dagster.buffer.maintenance import compact, vacuum
from trinity_dagster.buffer.reader import StepNotPinnedError, load_step_batch, to_tensors
from trinity_dagster.buffer.room import BufferRoom
from trinity_dagster.buffer.sampler import (
    NotEnoughDataError,
    PinOrderError,
    PinResult,
    PinShortfall,
    pin_batch,
    sampler_state,
)
from trinity_dagster.buffer.schema import BATCH_SCHEMA, EXPERIENCE_SCHEMA, QUARANTINE_SCHEMA
from trinity_dagster.buffer.state import SamplerState
from trinity_dagster.buffer.stats import table_stats, unconsumed_count
from trinity_dagster.buffer.writer import ExperienceWriter, WriteReport

__all__ = [
    "BATCH_SCHEMA",
    "EXPERIENCE_SCHEMA",
    "QUARANTINE_SCHEMA",
    "BufferRoom",
    "ExperienceWriter",
    "NotEnoughDataError",
    "PinOrderError",
    "PinResult",
    "PinShortfall",
    "SamplerState",
    "StepNotPinnedError",
    "WriteReport",
    "compact",
    "load_step_batch",
    "pin_batch",
    "sampler_state",
    "table_stats",
    "to_tensors",
    "unconsumed_count",
    "vacuum",
]
