"""End of data: an explorer marks that it will write no more experiences.

The built-in explorer marks it when its task set's epochs (`buffer.total_epochs`) are used
up or its last explore step is done; an external explorer calls `mark_end_of_data` when it
stops. The trainer, waiting for a batch that cannot fill any more, then stops cleanly with a
final save (as Trinity-RFT's trainer does on `StopAsyncIteration`).
"""

from __future__ import annotations

import json
import shutil
import time

from trinity_dagster.files import write_text_atomic
from trinity_dagster.handoff.wakeup import TRAINER, wake
from trinity_dagster.paths import RunPaths


def mark_end_of_data(paths: RunPaths, explorer_id: str, reason: str) -> None:
    """Record that `explorer_id` writes no more experiences, and why (and wake the trainer
    loop, which may be waiting for them)."""
    marker = paths.end_of_data / f"{explorer_id}.json"
    write_text_atomic(
        marker, json.dumps({"explorer_id": explorer_id, "reason": reason, "at": time.time()})
    )
    wake(paths.wakeup, TRAINER)


def end_of_data(paths: RunPaths) -> str | None:
    """Why no more data will come (the explorers' reasons), or None while data may come."""
    folder = paths.end_of_data
    if not folder.is_dir():
        return None
    reasons = [json.loads(p.read_text())["reason"] for p in sorted(folder.glob("*.json"))]
    return "; ".join(reasons) or None


def clear_end_of_data(paths: RunPaths) -> None:
    """Forget every explorer's end-of-data mark (a run is extended: data may come again)."""
    shutil.rmtree(paths.end_of_data, ignore_errors=True)
