"""The JSON record of each trained step (`logs/steps/step_NNNNNN.json`), written by rank 0.

A record is what the engine measured when it trained a step: metrics, batch size, parent
step, the health problems that keep its weights from explorers, and when it trained. It
lets a retried command return the step's result without training it again, and lets the
engine replay steps after a restart from an older checkpoint. No torch here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trinity_dagster.files import BackgroundFsync, write_text_atomic
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key

_RECORD_NAME = re.compile(r"step_(\d+)\.json")


def record_path(paths: RunPaths, step: int) -> Path:
    """The JSON record of a trained step."""
    return paths.step_records / f"step_{step_key(step)}.json"


def read_record(paths: RunPaths, step: int) -> dict[str, Any] | None:
    """The recorded result of a trained step, or None."""
    try:
        return json.loads(record_path(paths, step).read_text())
    except FileNotFoundError:
        return None


def write_record(
    paths: RunPaths, record: dict[str, Any], flush: BackgroundFsync | None = None
) -> None:
    """Write (atomically) the record of `record["step"]`; with `flush`, it is flushed to disk
    there, after this returns, rather than before."""
    path = record_path(paths, record["step"])
    write_text_atomic(path, json.dumps(record, indent=1), fsync=flush is None)
    if flush is not None:
        flush.add(path, path.parent)


def recorded_steps(paths: RunPaths) -> set[int]:
    """The steps that have a record (one directory listing, however far apart they are)."""
    try:
        names = [entry.name for entry in paths.step_records.iterdir()]
    except FileNotFoundError:
        return set()
    return {int(match[1]) for name in names if (match := _RECORD_NAME.fullmatch(name))}


def unrecorded_span(paths: RunPaths, first: int, last: int) -> tuple[int, int] | None:
    """The lowest and highest step of first..last without a record, or None if all have one.

    Costs one directory listing plus at most one look-up per record, not one per step, and
    nothing for an empty range (the next step of a running loop).
    """
    if first > last:
        return None
    recorded = recorded_steps(paths)
    low = first
    while low <= last and low in recorded:
        low += 1
    if low > last:
        return None
    high = last
    while high in recorded:
        high -= 1
    return low, high
