"""Experiment tracking (Trinity-RFT's `monitor`): the trainer loop hands every step's metrics
to the backends of `monitor.backends` (`tensorboard`, `mlflow`, `jsonl`) through
`open_monitor`; the Dagster metadata stays the primary per-step record."""

from trinity_dagster.monitor.base import Monitor, MonitorError
from trinity_dagster.monitor.registry import BACKENDS, MonitorGroup, open_monitor

__all__ = ["BACKENDS", "Monitor", "MonitorError", "MonitorGroup", "open_monitor"]
