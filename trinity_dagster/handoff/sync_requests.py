"""Explorer-driven sync (`synchronizer.sync_style: explorer_driven`): requests as small files.

An explorer that wants newer weights writes `weights/requests/<explorer_id>.json` with the
version it holds. The trainer sees the request at its next step boundary, or while it waits
for data, syncs if it has trained past that version, and answers by deleting the file; the
explorer then loads the newest published version (possibly the one it has, if the trainer
had nothing newer, so neither side waits for the other forever). No polling of a shared
marker for the answer: the file's absence is the answer.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from trinity_dagster.files import write_text_atomic
from trinity_dagster.handoff.wakeup import EXPLORER, TRAINER, wake
from trinity_dagster.paths import RunPaths


@dataclass(frozen=True)
class SyncRequest:
    """An explorer holding weights `have_version` asks for newer ones."""

    explorer_id: str
    have_version: int
    path: Path


def request_path(paths: RunPaths, explorer_id: str) -> Path:
    """Where the request of `explorer_id` lives."""
    if not explorer_id or "/" in explorer_id or explorer_id.startswith("."):
        raise ValueError(f"invalid explorer id {explorer_id!r}")
    return paths.sync_requests / f"{explorer_id}.json"


def request_sync(paths: RunPaths, explorer_id: str, have_version: int) -> Path:
    """Ask the trainer for weights newer than `have_version` (and wake its loop); returns the
    request file."""
    path = request_path(paths, explorer_id)
    write_text_atomic(path, json.dumps({"explorer_id": explorer_id, "have_version": have_version}))
    wake(paths.wakeup, TRAINER)
    return path


def pending_requests(paths: RunPaths) -> list[SyncRequest]:
    """The unanswered requests, by explorer id."""
    folder = paths.sync_requests
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # answered meanwhile
        found.append(SyncRequest(data["explorer_id"], int(data["have_version"]), path))
    return found


def answer_requests(paths: RunPaths, requests: list[SyncRequest]) -> None:
    """Answer requests (and wake the explorers): they may now load the newest published
    weights."""
    for request in requests:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(request.path)
    if requests:
        wake(paths.wakeup, EXPLORER)


def is_answered(path: Path) -> bool:
    """Whether the request written at `path` was answered."""
    return not path.exists()
