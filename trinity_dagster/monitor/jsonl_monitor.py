"""The `jsonl` backend: one JSON line per train step in `logs/metrics.jsonl`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.monitor.base import Monitor
from trinity_dagster.paths import RunPaths


def metrics_file(paths: RunPaths) -> Path:
    """The JSONL file of the run rooted at `paths`."""
    return paths.metrics_jsonl


class JsonlMonitor(Monitor):
    """Appends `{"step": N, "metrics": {...}}` per step; a resumed run appends after it."""

    def __init__(self, config: TrinityConfig) -> None:
        path = metrics_file(RunPaths.of_config(config))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")
        self._file.flush()

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Nothing: the file holds metrics only."""

    def log_final_model(self, hf_dir: Path) -> None:
        """Nothing: the file holds metrics only."""

    def close(self) -> None:
        self._file.close()
