"""The trainer's run state (`logs/trainer_state.json`): running, paused, finished or failed,
and why.

The trainer loop writes it; explorers read it while they wait for weights (a stopped trainer
will publish none), the sensors read it to know whether to start a trainer run, and the
`run` command reads it for the summary.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths

State = Literal["running", "paused", "finished", "failed"]
DATA_ENDED = "data ended"
STOPPED = "stopped by request"


@dataclass(frozen=True)
class TrainerState:
    """Where the trainer loop stands: `state`, the step it reached and why it stopped."""

    state: State
    step: int
    reason: str = ""
    updated_at: float = 0.0
    pid: int = 0
    host: str = ""

    def loop_alive(self) -> bool:
        """Whether a trainer loop is running now (judged by its pid on this machine; a loop
        on another machine counts as alive while its state says running)."""
        if self.state != "running":
            return False
        if self.host != socket.gethostname():
            return True
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def finished(self, total_steps: int | None) -> bool:
        """Whether training of a run with `total_steps` (None: until the data ends) is over:
        all steps trained, the data ended, or a user's request stopped it."""
        reached = total_steps is not None and self.step >= total_steps
        return self.state == "finished" and (
            reached or self.reason.startswith((DATA_ENDED, STOPPED))
        )


def state_path(paths: RunPaths) -> Path:
    """The state file of the run rooted at `paths`."""
    return paths.trainer_state_file


def write_trainer_state(paths: RunPaths, state: State, step: int, reason: str = "") -> None:
    """Record the trainer's state (atomically)."""
    record = TrainerState(state, step, reason, time.time(), os.getpid(), socket.gethostname())
    write_text_atomic(state_path(paths), json.dumps(asdict(record)))


def read_trainer_state(paths: RunPaths) -> TrainerState | None:
    """The recorded state, or None before the trainer first ran."""
    try:
        return TrainerState(**json.loads(state_path(paths).read_text()))
    except FileNotFoundError:
        return None


def finished_training(paths: RunPaths, total_steps: int | None) -> TrainerState | None:
    """The recorded state if the trainer finished the training of a run with `total_steps`."""
    state = read_trainer_state(paths)
    return state if state is not None and state.finished(total_steps) else None


def wait_for_training_end(
    paths: RunPaths,
    total_steps: int | None,
    *,
    while_waiting: Callable[[], None] = lambda: None,
    poll_s: float = 0.1,
) -> TrainerState | None:
    """The trainer's state once it finished the training of a run with `total_steps` (see
    `TrainerState.finished`), waiting only while a trainer loop runs; None as soon as none
    does (it failed, paused, ended a range of steps, or never started), since nothing may
    start one again soon. Calls `while_waiting` at every look."""
    while True:
        state = read_trainer_state(paths)
        if state is not None and state.finished(total_steps):
            return state
        if state is None or not state.loop_alive():
            return None
        while_waiting()
        time.sleep(poll_s)
