"""Waiting for the end of training, as the built-in explorer's run does before it scores the
run: through pauses and windows, and not past a failure."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from trinity_dagster.handoff.trainer_state import (
    finished_training,
    wait_for_training_end,
    write_trainer_state,
)
from trinity_dagster.paths import RunPaths


def later(seconds: float, action) -> threading.Thread:
    """Run `action` after `seconds` in a thread (the trainer, as the waiter sees it)."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_waits_through_a_pause_and_a_window_end_until_training_finished(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    write_trainer_state(paths, "paused", 2, "paused by request")
    looks = []

    def trainer() -> None:
        write_trainer_state(paths, "finished", 3, "the run's range ended at step 3")
        time.sleep(0.2)  # a window's end is not the end of training
        write_trainer_state(paths, "running", 4)
        time.sleep(0.1)
        write_trainer_state(paths, "finished", 4, "trained all 4 steps")

    thread = later(0.2, trainer)
    state = wait_for_training_end(paths, 4, while_waiting=lambda: looks.append(1), poll_s=0.02)
    thread.join()
    assert state is not None and state.step == 4 and state.state == "finished"
    assert len(looks) >= 10
    assert finished_training(paths, 4) == state
    assert finished_training(paths, 5) is None


def test_gives_up_when_the_trainer_failed(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    write_trainer_state(paths, "running", 1)
    thread = later(0.1, lambda: write_trainer_state(paths, "failed", 1, "NaN loss"))
    assert wait_for_training_end(paths, 4, poll_s=0.02) is None
    thread.join()
