"""Fault injection for crash-recovery tests: engine rank 0 kills or hangs itself at a window.

    TRINITY_DAGSTER_FAULT=<window>[:<step>][:hang]

arms one fault: when rank 0 of the engine service reaches `<window>` (of step `<step>`, or
of any step), it SIGKILLs its own process, or with `hang` blocks the calling thread forever.
Windows (`WINDOWS`):
- `train_forward`: a transformer layer's forward; `train_backward`: a layer's gradient;
- `optimizer_step`: just before the optimizer updates the weights;
- `checkpoint_write`: the engine state handed to its writer in `.global_step_N.tmp-*`
  (mid-write for a background save, written without a manifest for a blocking one);
- `checkpoint_renamed`: `global_step_N/` renamed into place, the markers not moved;
- `weights_publish`: `weights/.global_step_N.tmp-*` written, not renamed;
- `weights_renamed`: `weights/global_step_N/` in place, the marker not moved;
- `shm_upload`: the /dev/shm region written under its temp name, not renamed.

The variable is read once, at import; unset, `fault_point` returns at once. A fault fires
once per run root: just before it fires, `service/fault_fired.json` is written under the run
root, and a service that finds that file (the restarted one) does not arm the fault.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths

ENV = "TRINITY_DAGSTER_FAULT"
WINDOWS = (
    "train_forward",
    "train_backward",
    "optimizer_step",
    "checkpoint_write",
    "checkpoint_renamed",
    "weights_publish",
    "weights_renamed",
    "shm_upload",
)
Mode = Literal["kill", "hang"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """Where (window and optional step) and how (`kill` or `hang`) rank 0 fails."""

    window: str
    step: int | None
    mode: Mode

    def matches(self, window: str, step: int | None) -> bool:
        """Whether reaching `window` of `step` triggers this fault."""
        return window == self.window and (self.step is None or self.step == step)


def parse_fault(text: str) -> Fault | None:
    """The fault `<window>[:<step>][:hang]` names (None for an empty text)."""
    if not text:
        return None
    parts = text.split(":")
    window, rest = parts[0], parts[1:]
    mode: Mode = "kill"
    if rest and rest[-1] in ("kill", "hang"):
        mode = "hang" if rest.pop() == "hang" else "kill"
    if window not in WINDOWS or len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise ValueError(
            f"{ENV}={text!r}: expected <window>[:<step>][:hang] with a window out of "
            f"{', '.join(WINDOWS)}"
        )
    return Fault(window, int(rest[0]) if rest else None, mode)


_REQUESTED = parse_fault(os.environ.get(ENV, ""))  # read once: no cost per step
_armed: Fault | None = None
_fired_file: Path | None = None


def fired_path(paths: RunPaths) -> Path:
    """The file that says the run root's fault has fired (and must not fire again)."""
    return paths.fault_fired


def arm(paths: RunPaths, rank: int) -> Fault | None:
    """Arm the fault of the environment in this process (rank 0 only), unless it has already
    fired for this run root; returns the armed fault."""
    global _armed, _fired_file
    fired = fired_path(paths)
    if _REQUESTED is None or rank != 0 or fired.exists():
        _armed = None
        return None
    _armed, _fired_file = _REQUESTED, fired
    log.warning("fault injection armed: %s (%s)", _REQUESTED, ENV)
    return _armed


def fault_point(window: str, step: int | None = None) -> None:
    """Fail here if the armed fault names this window (and step)."""
    if _armed is None or not _armed.matches(window, step):
        return
    _fire(_armed, window, step)


def _fire(fault: Fault, window: str, step: int | None) -> None:
    """Record that the fault fired, then kill this process or block this thread forever."""
    global _armed
    _armed = None
    assert _fired_file is not None
    record = {"window": window, "step": step, "mode": fault.mode, "pid": os.getpid()}
    write_text_atomic(_fired_file, json.dumps({**record, "fired_at": time.time()}))
    log.warning("fault injection fires: %s of step %s (%s)", window, step, fault.mode)
    if fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)
