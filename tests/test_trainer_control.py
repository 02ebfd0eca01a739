"""The trainer loop serves control requests (save, sync, pause, stop) from Dagster runs.

The loop runs in a thread over the fake engine of `tests/support/trainer_loop.py` and real
Delta batches; the test plays the asking run through `trinity_dagster.handoff.control`, as the
UI's runs do.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.trainer_loop import FakeEngine, RecordingHook, loop_config, start_in_thread
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff import control
from trinity_dagster.handoff.end_of_data import mark_end_of_data
from trinity_dagster.handoff.trainer_state import STOPPED, read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import fill_buffer
from trinity_dagster.trainer import Trainer

pytestmark = pytest.mark.usefixtures("no_initial_model")


def ask(paths: RunPaths, request_id: str, action: control.Action, **kw: Any) -> dict[str, Any]:
    """Submit a request and wait (20 s at most) for the loop's answer."""
    request = control.submit_request(paths, request_id, action, **kw)
    found = control.wait_for_answer(paths, request, loop_alive=lambda: True, timeout_s=20)
    assert found is not None
    return found


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.02)


@dataclass
class Loop:
    """A trainer loop running in a thread over a fake engine."""

    config: TrinityConfig
    paths: RunPaths
    engine: FakeEngine
    hook: RecordingHook
    thread: threading.Thread
    outcome: dict[str, Any]


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    """A loop of 5 steps (no scheduled save, no scheduled sync) waiting for step 2's data."""
    config = loop_config(tmp_path, total_steps=5, sync_interval=100, save_hf_checkpoint="last")
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 1)
    engine, hook = FakeEngine(), RecordingHook()
    thread, outcome = start_in_thread(Trainer(config, engine=engine, hook=hook))
    hook.wait_for_step(1)
    yield Loop(config, paths, engine, hook, thread, outcome)
    mark_end_of_data(paths, "e0", "test over")  # never leave the thread waiting
    thread.join(30)


def test_save_and_sync_now_are_served_while_the_loop_waits(loop: Loop) -> None:
    saved = ask(loop.paths, "run-a.save.1", "save", step=1, hf=True)
    assert saved["ok"] and saved["path"].endswith("checkpoints/global_step_1"), saved
    assert loop.engine.of_kind("save") == [("save", 1, False, True, True)]

    synced = ask(loop.paths, "run-b.sync.1", "sync", step=1)
    assert synced["ok"] and synced["version"] == 1, synced
    assert loop.engine.of_kind("publish") == [("publish", 1)]
    assert loop.hook.syncs == [], "the asking run records a requested sync, not the loop"
    assert loop.thread.is_alive() and loop.engine.of_kind("train") == [("train", 1)]


def test_a_later_step_is_saved_when_the_loop_gets_there(loop: Loop) -> None:
    request = control.submit_request(loop.paths, "run-a.save.3", "save", step=3)
    time.sleep(0.3)
    assert control.read_answer(loop.paths, request.request_id) is None
    assert control.open_save_steps(loop.paths) == {3: ["run-a.save.3"]}
    fill_buffer(loop.config, 2, seed=1)
    found = control.wait_for_answer(loop.paths, request, loop_alive=lambda: True, timeout_s=20)
    assert found is not None and found["ok"], found
    saves = loop.engine.of_kind("save")
    assert saves == [("save", 3, False, True, True)], saves  # a weights version
    assert loop.engine.of_kind("train")[-1] == ("train", 3)
    assert control.open_save_steps(loop.paths) == {3: ["run-a.save.3"]}  # until the run records it
    control.forget(loop.paths, request.request_id)
    assert control.open_save_steps(loop.paths) == {}


def test_a_step_that_is_gone_is_refused_naming_what_can_be_saved(loop: Loop) -> None:
    fill_buffer(loop.config, 1, seed=1)
    loop.hook.wait_for_step(2)
    refused = ask(loop.paths, "run-a.save.1", "save", step=1)
    assert not refused["ok"]
    assert "step 1 can no longer be saved: the engine is at step 2" in refused["message"]
    assert "kept checkpoints: none" in refused["message"]
    unpublished = ask(loop.paths, "run-b.sync.1", "sync", step=1)
    assert not unpublished["ok"] and "were not published" in unpublished["message"]
    beyond = ask(loop.paths, "run-c.save.9", "save", step=9)
    assert not beyond["ok"] and "training ends at step 5" in beyond["message"]
    assert loop.engine.of_kind("save") == [] and loop.engine.of_kind("publish") == []
    assert loop.thread.is_alive(), "a refused request does not stop training"


def test_pause_ends_the_loop_after_the_step_and_a_new_loop_resumes(loop: Loop) -> None:
    later = control.submit_request(loop.paths, "run-x.save.4", "save", step=4)
    paused = ask(loop.paths, "run-a.pause.now", "pause")
    loop.thread.join(20)
    assert not loop.thread.is_alive()
    assert paused["ok"] and paused["step"] == 1, paused
    assert loop.outcome["reason"] == "paused by request run-a.pause.now at step 1", loop.outcome
    state = read_trainer_state(loop.paths)
    assert state is not None and state.state == "paused" and state.step == 1
    assert not state.loop_alive()
    assert loop.engine.of_kind("save") == [], "a pause is no end of training: no final save"
    left = control.read_answer(loop.paths, later.request_id)
    assert left is not None and not left["ok"] and "ended before serving it" in left["message"]

    # a new loop goes on from the engine's step, to the end
    fill_buffer(loop.config, 4, seed=1)
    reason = asyncio.run(Trainer(loop.config, engine=loop.engine, hook=loop.hook).run())
    assert reason.startswith("trained all 5 steps")
    assert [e[1] for e in loop.engine.of_kind("train")] == [1, 2, 3, 4, 5]


def test_stop_ends_training_with_the_final_save(loop: Loop) -> None:
    stopped = ask(loop.paths, "run-a.stop.now", "stop")
    loop.thread.join(20)
    assert stopped["ok"] and stopped["step"] == 1, stopped
    assert loop.outcome["reason"].startswith(f"{STOPPED} run-a.stop.now at step 1"), loop.outcome
    assert loop.engine.of_kind("save") == [("save", 1, True, True, True)]
    state = read_trainer_state(loop.paths)
    assert state is not None and state.state == "finished"
    assert state.finished(loop.config.trainer.total_steps), "a stopped training is finished"


def test_requests_are_claimed_once(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    request = control.submit_request(paths, "run-a.sync.2", "sync", step=2)
    assert control.pending_requests(paths) == [request]
    assert control.claim(paths, request)
    assert not control.claim(paths, request), "a second server must not get it"
    # with no loop alive the asking run takes its request back and serves it itself
    again = control.submit_request(paths, "run-a.sync.2", "sync", step=2)
    assert control.wait_for_answer(paths, again, loop_alive=lambda: False, timeout_s=5) is None
    assert control.pending_requests(paths) == []
    with pytest.raises(ValueError, match="needs a step >= 1"):
        control.submit_request(paths, "run-b.save.0", "save", step=0)
    with pytest.raises(ValueError, match="unknown control action"):
        control.submit_request(paths, "run-b.x", "restart")  # type: ignore[arg-type]


def test_a_request_claimed_by_a_loop_that_just_ended_waits_for_its_answer(
    tmp_path: Path,
) -> None:
    # a loop writes its final state (no longer alive), then answers the pause it claimed: the
    # asking run must take that answer, not serve the pause itself
    paths = RunPaths.of(tmp_path)
    request = control.submit_request(paths, "run-a.pause.now", "pause")
    assert control.claim(paths, request)
    answered = threading.Timer(
        0.5, lambda: control.answer(paths, request, ok=True, message="paused", step=3)
    )
    answered.start()
    found = control.wait_for_answer(paths, request, loop_alive=lambda: False, timeout_s=5)
    answered.join()
    assert found is not None and found["step"] == 3, found
    # a loop that died between its claim and its answer leaves the request to the caller
    lost = control.submit_request(paths, "run-b.pause.now", "pause")
    assert control.claim(paths, lost)
    started = time.monotonic()
    assert (
        control.wait_for_answer(
            paths, lost, loop_alive=lambda: False, timeout_s=5, claimed_grace_s=0.5
        )
        is None
    )
    assert 0.5 <= time.monotonic() - started < 2


def test_the_pause_mark(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    assert control.paused_by(paths) is None and not control.clear_paused(paths)
    control.set_paused(paths, by="run-a")
    assert control.paused_by(paths) == "run-a"
    assert control.clear_paused(paths) and control.paused_by(paths) is None
