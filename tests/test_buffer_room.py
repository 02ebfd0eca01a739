"""`buffer.capacity`: the room the built-in explorer waits for, counted from the buffer's
tables, and the pins that make it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.buffer import BUFFER_RUN, make_rows
from trinity_dagster.buffer import ExperienceWriter, pin_batch, unconsumed_count
from trinity_dagster.buffer.room import BufferRoom
from trinity_dagster.config import ConfigError, TrinityConfig, load_config
from trinity_dagster.explorer.loop import ExplorerLoop
from trinity_dagster.handoff import wakeup
from trinity_dagster.handoff.trainer_state import write_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import config_at


def room_config(root: Path, capacity: int = 8, **overrides: object) -> TrinityConfig:
    """Batches of 4 rows, explore steps of 2 tasks x 2 rows: a capacity of at least 7."""
    keys = {"explorer.tasks_per_step": 2, "buffer.capacity": capacity, **overrides}
    return config_at(root, BUFFER_RUN, keys)


def test_room_fills_with_writes_and_empties_with_pins(tmp_path: Path) -> None:
    config = room_config(tmp_path)
    room, writer = BufferRoom(config), ExperienceWriter(config)
    assert room.fits(4) and room.unconsumed == 0
    room.wrote(writer.write(make_rows("a", 4)))
    assert room.fits(4) and room.unconsumed == 4
    room.wrote(writer.write(make_rows("b", 4)))
    assert not room.fits(1) and room.unconsumed == 8 == unconsumed_count(config)
    pin_batch(config, 1, force=True)  # the trainer takes 4 of them
    assert room.fits(4) and not room.fits(5) and room.unconsumed == 4


def test_rows_written_by_others_count_too(tmp_path: Path) -> None:
    config = room_config(tmp_path)
    room = BufferRoom(config)
    assert room.fits(8)
    ExperienceWriter(config).write(make_rows("other", 6))  # another explorer's commit
    assert not room.fits(4) and room.fits(2) and room.unconsumed == 6


def test_without_a_capacity_everything_fits(tmp_path: Path) -> None:
    config = config_at(tmp_path, BUFFER_RUN)
    ExperienceWriter(config).write(make_rows("a", 8))
    assert BufferRoom(config).fits(10**9)


def test_a_capacity_that_could_leave_both_sides_waiting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"buffer\.capacity.*6 is too small.*at least 7"):
        room_config(tmp_path, capacity=6)
    assert room_config(tmp_path, capacity=7).buffer.capacity == 7
    # SFT steps write a batch of demonstrations each: 8 rows here, more than a step's 4
    warm = {"buffer.train_batch_size": 8, "trainer.sft_warmup_steps": 2}
    with pytest.raises(ConfigError, match="at least 15"):
        room_config(tmp_path, capacity=14, **warm)


def test_an_explorer_waits_for_room_until_the_trainer_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = room_config(tmp_path, **{"synchronizer.sync_timeout": 0.3})
    ExperienceWriter(short).write(make_rows("a", 8))
    loop = ExplorerLoop(short)
    try:
        with pytest.raises(TimeoutError, match=r"explore step 3 needs room for 4 .*capacity 8"):
            loop._wait_for_room(3, demonstrations=False)
    finally:
        loop.close()

    monkeypatch.setattr(wakeup, "LISTENING_POLL_S", 5.0)  # only a wake-up ends a wait early
    loop = ExplorerLoop(room_config(tmp_path))
    try:
        pinner = threading.Timer(0.3, pin_batch, (short, 1), {"force": True})
        started = time.monotonic()
        pinner.start()
        assert loop._wait_for_room(3, demonstrations=False) == ""
        assert time.monotonic() - started < 3  # woken by the pin, not by a poll
        pinner.join()
        write_trainer_state(RunPaths.of_config(short), "finished", 6, "trained all 6 steps")
        ExperienceWriter(short).write(make_rows("b", 4))  # full again
        assert loop._wait_for_room(4, demonstrations=False).startswith("the trainer finished")
    finally:
        loop.close()


def test_the_loop_runs_at_most_a_capacity_ahead_of_the_trainer(tmp_path: Path) -> None:
    """The demo's SFT steps write a batch of demonstrations each; a capacity of one batch and
    one step's rows (less one) lets the explorer write one step beyond what is pinned."""
    overrides = {
        "run_root": str(tmp_path / "run"),
        "trainer.sft_warmup_steps": 3,
        "synchronizer.sync_timeout": 0.5,
    }
    config = load_config(None, overrides)
    batch = config.buffer.train_batch_size
    step_rows = config.explorer.tasks_per_step * config.algorithm.repeat_times
    assert step_rows >= batch  # a generating step writes at least a batch of demonstrations
    config = load_config(None, {**overrides, "buffer.capacity": batch + step_rows - 1})
    reports: dict[int, dict[str, object]] = {}
    loop = ExplorerLoop(config, on_step=reports.__setitem__)
    try:
        with pytest.raises(TimeoutError, match="explore step 2 needs room"):
            loop.run(1, 3)
        assert reports[1]["buffer_unconsumed"] == config.buffer.train_batch_size
        assert 0 <= reports[1]["time/wait_room"] < 0.5  # step 1 found room at once
        pin_batch(config, 1, force=True)  # the trainer trains step 1: room for step 2
        assert loop.run(2, 2) == "explored up to step 2, the end of the requested range"
        assert unconsumed_count(config) == config.buffer.train_batch_size
    finally:
        loop.close()


def test_an_explorer_of_ones_own_waits_for_room_with_the_same_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explorer that is not the built-in one writes with `ExperienceWriter` and waits
    with `BufferRoom.wait` before each write."""
    monkeypatch.setattr(wakeup, "LISTENING_POLL_S", 5.0)  # only a wake-up ends a wait early
    config = room_config(tmp_path)
    room, writer = BufferRoom(config), ExperienceWriter(config)
    room.wait(8, timeout_s=0)  # empty: no wait
    room.wrote(writer.write(make_rows("a", 8)))
    full = r"no room for 4 experiences within 0\.2 s: 8 unconsumed"
    with pytest.raises(TimeoutError, match=full):
        room.wait(4, timeout_s=0.2)
    with pytest.raises(ValueError, match=r"9 experiences never fit in buffer\.capacity 8"):
        room.wait(9, timeout_s=60)
    pinner = threading.Timer(0.3, pin_batch, (config, 1), {"force": True})
    started = time.monotonic()
    pinner.start()
    room.wait(4, timeout_s=60)
    assert time.monotonic() - started < 3  # woken by the pin, not by a poll
    pinner.join()
    assert not list(RunPaths.of_config(config).wakeup.glob("*.sock"))  # stopped listening
