"""The JSON record of each trained step (`logs/steps/step_NNNNNN.json`), written by rank 0.

A record is what the engine measured when it trained a step: metrics, batch size, parent
step, the health problems that keep its weights from explorers, and when it trained. It
lets a retried command return the step's result without training it again, and lets the
engine replay steps after a restart from an older checkpoint. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trinity_dagster.checkpoint.layout import write_atomic
from trinity_dagster.paths import RunPaths

RECORDS_DIR = "steps"
STEP_FILE_WIDTH = 6


def record_path(paths: RunPaths, step: int) -> Path:
    """The JSON record of a trained step."""
    return paths.logs / RECORDS_DIR / f"step_{step:0{STEP_FILE_WIDTH}d}.json"


def read_record(paths: RunPaths, step: int) -> dict[str, Any] | None:
    """The recorded result of a trained step, or None."""
    try:
        return json.loads(record_path(paths, step).read_text())
    except FileNotFoundError:
        return None


def write_record(paths: RunPaths, record: dict[str, Any]) -> None:
    """Write (atomically) the record of `record["step"]`."""
    write_atomic(record_path(paths, record["step"]), json.dumps(record, indent=1))
