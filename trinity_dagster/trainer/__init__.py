"""Trinity-RFT's trainer API: `Trainer`, `TrainEngineWrapper`, `get_trainer_wrapper`,
`CheckpointMonitor` (see docs/design.md for how each maps onto the Dagster graph).

`Trainer`, `TrainerHook` and `SyncWithheldError` are imported on first use: the loop pins
batches with the data libraries (pyarrow, deltalake), which a process that only drives the
engine (Dagster's code server, through the engine resource) does without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trinity_dagster.checkpoint.markers import CheckpointMonitor
from trinity_dagster.trainer.engine_wrapper import (
    ServiceEngineWrapper,
    TrainEngineWrapper,
    get_trainer_wrapper,
)

if TYPE_CHECKING:
    from trinity_dagster.trainer.trainer import SyncWithheldError, Trainer, TrainerHook

_LOOP_NAMES = ("SyncWithheldError", "Trainer", "TrainerHook")

__all__ = [
    "CheckpointMonitor",
    "ServiceEngineWrapper",
    "SyncWithheldError",
    "TrainEngineWrapper",
    "Trainer",
    "TrainerHook",
    "get_trainer_wrapper",
]


def __getattr__(name: str) -> Any:
    """The loop's names (`_LOOP_NAMES`), from `trinity_dagster.trainer.trainer` on first use."""
    if name in _LOOP_NAMES:
        from trinity_dagster.trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
