"""The `tensorboard` backend: event files under `logs/tensorboard/`, one scalar per metric.

Written with TensorBoard's own event-file writer (numpy and protobuf only), so the trainer
process imports no torch; `tensorboard --logdir <run_root>/logs/tensorboard` shows them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from trinity_dagster.config import TrinityConfig
from trinity_dagster.monitor.base import Monitor, markdown_table, scalars
from trinity_dagster.paths import RunPaths


def tensorboard_dir(paths: RunPaths) -> Path:
    """The TensorBoard log directory of the run rooted at `paths`."""
    return paths.tensorboard


class TensorBoardMonitor(Monitor):
    """One event per train step holding its numeric metrics; each start adds an event file."""

    def __init__(self, config: TrinityConfig) -> None:
        self._writer = EventFileWriter(str(tensorboard_dir(RunPaths.of_config(config))))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = [
            Summary.Value(tag=name, simple_value=value) for name, value in scalars(metrics).items()
        ]
        self._writer.add_event(
            Event(wall_time=time.time(), step=step, summary=Summary(value=values))
        )
        self._writer.flush()  # visible to TensorBoard now, and kept if the process is killed

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A Markdown table in TensorBoard's Text tab, under the tag `name`."""
        summary = text_pb(name, markdown_table(rows))
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def log_final_model(self, hf_dir: Path) -> None:
        """Nothing: TensorBoard shows no models."""

    def close(self) -> None:
        self._writer.close()
