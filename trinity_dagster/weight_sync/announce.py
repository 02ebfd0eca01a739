"""`service/collective_weights.json`: the newest weights version the running engine service
holds for collective sync, so explorers learn of a version with one small file read.

The file names the service's rank-0 pid. It counts only while the service state file names
the same pid and, on rank 0's machine, that process lives: a service that died (its held
versions with it) or stopped announces nothing, explorers wait, and the trainer holds its
newest weights again (`Trainer` checks `announced_version`). No torch here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.state import pid_alive, read_state


def announce_path(paths: RunPaths) -> Path:
    """Where the running service announces its newest held version."""
    return paths.weights_announcement


def announce(paths: RunPaths, version: int) -> None:
    """Announce `version` as this process's (engine rank 0's) newest held version."""
    write_text_atomic(announce_path(paths), json.dumps({"version": version, "pid": os.getpid()}))


def withdraw(paths: RunPaths) -> None:
    """Remove this process's announcement (the service stops)."""
    path = announce_path(paths)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (FileNotFoundError, json.JSONDecodeError):
        pass


def announced_version(paths: RunPaths) -> int | None:
    """The version the live service holds for collective sync, or None."""
    try:
        data = json.loads(announce_path(paths).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    state = read_state(paths)
    if state is None or state.pid != data.get("pid"):
        return None
    if state.is_local and not pid_alive(state.pid):
        return None
    return int(data["version"])
