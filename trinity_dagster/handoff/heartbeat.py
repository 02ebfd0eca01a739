"""The built-in explorer's heartbeat: a file it touches while its loop makes progress.

The explorer loop beats at every explore step and, while it waits for weights, about once a
second, so a loop that stops beating for `explorer.step_timeout_s` is hung (a frozen
generation or reward function): `rft_loop_sensor` then ends its run, and the run is started
again from the step it was on, as after a crash.
"""

from __future__ import annotations

import time
from pathlib import Path

from trinity_dagster.paths import RunPaths

BEAT_EVERY_S = 1.0
BUILTIN_EXPLORER_ID = "explorer-0"  # the explorer that the graph's `rollouts` runs


def heartbeat_path(paths: RunPaths, explorer_id: str) -> Path:
    """The heartbeat file of explorer `explorer_id`."""
    return paths.heartbeats / f"{explorer_id}.beat"


class Heartbeat:
    """Beats for one explorer, at most once every `BEAT_EVERY_S` unless forced."""

    def __init__(self, paths: RunPaths, explorer_id: str) -> None:
        self.path = heartbeat_path(paths, explorer_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last = 0.0

    def beat(self, *, force: bool = False) -> None:
        """Record that the loop is making progress now."""
        now = time.monotonic()
        if force or now - self._last >= BEAT_EVERY_S:
            self.path.touch()
            self._last = now


def seconds_since_beat(paths: RunPaths, explorer_id: str) -> float | None:
    """Seconds since explorer `explorer_id` last beat, or None if it never did."""
    try:
        return time.time() - heartbeat_path(paths, explorer_id).stat().st_mtime
    except FileNotFoundError:
        return None
