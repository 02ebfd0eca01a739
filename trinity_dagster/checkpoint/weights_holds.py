"""Holds on published weights versions: a reader keeps its version from being pruned.

A reader (an evaluation, an explorer loading new weights) writes
`weights/holds/<version>-<pid>-<random>.json` before it opens version V and removes it when
it has loaded; `publish.prune_published` keeps every held version. A hold whose process is
gone (a reader killed mid-load) no longer counts and is removed by the next pruning.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths


def _holds_dir(paths: RunPaths) -> Path:
    return paths.weights_holds


@contextmanager
def hold_weights(paths: RunPaths, version: int) -> Iterator[None]:
    """Keep weights `version` from being pruned while the block runs."""
    path = _holds_dir(paths) / f"{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    record = {"version": version, "pid": os.getpid(), "host": socket.gethostname()}
    write_text_atomic(path, json.dumps(record), fsync=False)  # a hold ends with its process
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def held_versions(paths: RunPaths) -> set[int]:
    """The versions some live reader holds; holds of dead readers are removed."""
    folder = _holds_dir(paths)
    held: set[int] = set()
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue  # released meanwhile, or still being renamed into place
        if record["host"] == socket.gethostname() and not _alive(record["pid"]):
            path.unlink(missing_ok=True)
            continue
        held.add(int(record["version"]))
    return held


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
