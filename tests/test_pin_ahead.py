"""Pinning the next batch while a step trains (`trainer/pin_ahead.py`), alone and in the loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from tests.support.trainer_loop import FakeEngine, loop_config
from trinity_dagster.buffer.sampler import BatchPinner, PinResult
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff import control, wakeup
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import fill_buffer
from trinity_dagster.trainer import Trainer
from trinity_dagster.trainer.pin_ahead import PinAhead

pytestmark = pytest.mark.usefixtures("no_initial_model")


def pinned_steps(paths: RunPaths) -> dict[int, list[str]]:
    """The eids of each pinned step's training rows, as `batches` holds them."""
    rows = DeltaTable(paths.batches).to_pyarrow_table(columns=["step", "kind", "position", "eid"])
    steps: dict[int, list[tuple[int, str]]] = {}
    for row in rows.to_pylist():
        if row["kind"] == "train":
            steps.setdefault(row["step"], []).append((row["position"], row["eid"]))
    return {step: [eid for _, eid in sorted(found)] for step, found in steps.items()}


def wait_pinned(paths: RunPaths, step: int, timeout_s: float = 5.0) -> bool:
    """Whether `step` is pinned within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while step not in pinned_steps(paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def step_one_pinned(tmp_path: Path) -> tuple[TrinityConfig, BatchPinner, PinResult]:
    """A 4-step loop's config with the rows of step 1 written and pinned: the pinner and
    that pin."""
    config = loop_config(tmp_path, total_steps=4)
    fill_buffer(config, 1, seed=1)
    pinner = BatchPinner(config)
    first = pinner.pin(1)
    assert isinstance(first, PinResult)
    return config, pinner, first


def test_a_pin_ahead_waits_for_rows_and_is_taken_by_its_step_only(tmp_path: Path) -> None:
    config, pinner, first = step_one_pinned(tmp_path)
    paths = RunPaths.of(config.run_root)
    ahead = PinAhead(pinner, paths.experiences, paths.wakeup)
    try:
        ahead.start(2, first.source_version)  # no rows for step 2 until `take`: no pin
        assert not wait_pinned(paths, 2, timeout_s=0.3)
        assert ahead.take(2) is None

        ahead.start(2, first.source_version)
        fill_buffer(config, 1, seed=2)  # rows committed after the start are pinned
        assert wait_pinned(paths, 2)
        second = ahead.take(2)
        assert isinstance(second, PinResult) and second.step == 2
        assert pinned_steps(paths)[2] == second.eids

        ahead.start(3, second.source_version)
        fill_buffer(config, 1, seed=3)
        assert wait_pinned(paths, 3)
        assert ahead.take(4) is None  # another step's pin is not handed out...
        again = pinner.pin(3)  # ...but it stays pinned, as an interrupted step's would
        assert isinstance(again, PinResult) and again.already_pinned
    finally:
        ahead.close()


def test_a_pin_ahead_is_woken_by_the_commit_and_its_take_ends_its_wait(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # with a poll far longer than the test, only wake-ups can make it pin or stop in time
    monkeypatch.setattr(wakeup, "LISTENING_POLL_S", 600.0)
    config, pinner, first = step_one_pinned(short_tmp_path)
    paths = RunPaths.of(config.run_root)
    ahead = PinAhead(pinner, paths.experiences, paths.wakeup)
    try:
        ahead.start(2, first.source_version)
        time.sleep(0.2)  # the worker waits
        fill_buffer(config, 1, seed=2)  # the writer's commit wakes it
        assert wait_pinned(paths, 2, timeout_s=60)
        assert isinstance(ahead.take(2), PinResult)

        ahead.start(3, first.source_version)
        time.sleep(0.2)
        started = time.monotonic()
        assert ahead.take(3) is None  # no rows: `take` ends the worker's wait
        assert time.monotonic() - started < 60
    finally:
        ahead.close()
    assert not list(paths.wakeup.glob("trainer.pin-ahead.*"))  # closed, its socket removed


class ExplorerAheadEngine(FakeEngine):
    """While it trains step N, an explorer commits the rows of one more step; it waits
    (up to 5 s) to see whether the loop pins step N+1 meanwhile."""

    def __init__(self, config: Any, paths: RunPaths) -> None:
        super().__init__()
        self.config = config
        self.paths = paths
        self.pinned_while_training: dict[int, bool] = {}

    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        step = batch.step
        fill_buffer(self.config, 1, seed=100 + step)
        if step < self.config.trainer.total_steps:
            self.pinned_while_training[step] = wait_pinned(self.paths, step + 1)
        return super().train_step(batch, publish=publish)


def run_ahead(
    tmp_path: Path, engine_type: type[ExplorerAheadEngine]
) -> tuple[RunPaths, ExplorerAheadEngine, str]:
    """A 4-step loop over `engine_type` from one step's rows: the run's paths, the engine
    and why the loop stopped."""
    config = loop_config(tmp_path, total_steps=4)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 1, seed=1)
    engine = engine_type(config, paths)
    return paths, engine, asyncio.run(Trainer(config, engine=engine).run())


def test_the_next_batch_is_pinned_while_a_step_trains(tmp_path: Path) -> None:
    paths, engine, reason = run_ahead(tmp_path, ExplorerAheadEngine)

    assert reason.startswith("trained all 4 steps"), reason
    # steps 2-4 were pinned during the step before; nothing past the last step, whose rows
    # were there too
    assert engine.pinned_while_training == {1: True, 2: True, 3: True}
    pinned = pinned_steps(paths)
    assert sorted(pinned) == [1, 2, 3, 4]
    assert engine.batches == pinned  # each step trained the rows pinned for it
    eids = [eid for step in pinned.values() for eid in step]
    assert len(eids) == len(set(eids))


class PausingEngine(ExplorerAheadEngine):
    """`ExplorerAheadEngine` that asks the loop to pause while it trains step 2."""

    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        result = super().train_step(batch, publish=publish)  # step 3 is pinned ahead by now
        if batch.step == 2:
            control.submit_request(self.paths, "run-a.pause.now", "pause")
        return result


def test_a_pause_after_a_pin_ahead_leaves_it_for_the_next_run(tmp_path: Path) -> None:
    paths, engine, reason = run_ahead(tmp_path, PausingEngine)

    assert reason == "paused by request run-a.pause.now at step 2", reason
    state = read_trainer_state(paths)
    assert state is not None and state.state == "paused" and state.step == 2
    ahead = pinned_steps(paths)[3]  # pinned, not trained
    assert sorted(engine.batches) == [1, 2]

    control.clear_paused(paths)
    reason = asyncio.run(Trainer(engine.config, engine=engine).run())
    assert reason.startswith("trained all 4 steps"), reason
    assert engine.batches[3] == ahead  # the next run trained the rows pinned ahead
    assert engine.batches == pinned_steps(paths)
