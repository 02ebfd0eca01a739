"""Waiting for the end of training, as the built-in explorer's run does before it scores the
run: only while a trainer loop runs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from trinity_dagster.handoff.trainer_state import (
    finished_training,
    state_path,
    wait_for_training_end,
    write_trainer_state,
)
from trinity_dagster.paths import RunPaths


def test_waits_while_the_trainer_loop_runs_until_training_finished(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    write_trainer_state(paths, "running", 3)  # this process stands for the trainer's
    looks = []

    def trainer() -> None:
        time.sleep(0.3)
        write_trainer_state(paths, "finished", 4, "trained all 4 steps")

    thread = threading.Thread(target=trainer)
    thread.start()
    state = wait_for_training_end(paths, 4, while_waiting=lambda: looks.append(1), poll_s=0.02)
    thread.join()
    assert state is not None and state.step == 4 and state.state == "finished"
    assert len(looks) >= 5
    assert finished_training(paths, 4) == state
    assert finished_training(paths, 5) is None


@pytest.mark.parametrize(
    ("state", "step", "reason"),
    [
        ("failed", 2, "NaN loss"),
        ("paused", 2, "paused by request"),
        ("finished", 2, "trained up to step 2, the end of the requested range"),
    ],
)
def test_does_not_wait_when_no_trainer_loop_runs(
    tmp_path: Path, state: str, step: int, reason: str
) -> None:
    paths = RunPaths.of(tmp_path)
    assert wait_for_training_end(paths, 4, poll_s=0.02) is None  # never started
    write_trainer_state(paths, state, step, reason)  # type: ignore[arg-type]
    assert wait_for_training_end(paths, 4, poll_s=0.02) is None


def test_does_not_wait_for_a_trainer_whose_process_is_gone(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    write_trainer_state(paths, "running", 2)
    record = json.loads(state_path(paths).read_text())
    record["pid"] = 2**22 + 12345  # no such process
    state_path(paths).write_text(json.dumps(record))
    assert wait_for_training_end(paths, 4, poll_s=0.02) is None
