"""`CheckpointMonitor`: the `latest_*` markers move only after every save thread of a step."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from trinity_dagster.checkpoint.layout import latest_checkpoint_step, latest_weights_version
from trinity_dagster.paths import RunPaths
from trinity_dagster.trainer import CheckpointMonitor


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    return RunPaths.of(str(tmp_path / "run"))


def _save_threads(
    monitor: CheckpointMonitor,
    step: int,
    count: int,
    *,
    is_state_dict: bool,
    release: threading.Event,
) -> list[threading.Thread]:
    """`count` started save threads of `step` that finish once `release` is set."""

    def save() -> None:
        monitor.notify_started(step, is_state_dict)
        assert release.wait(10)
        monitor.notify_finished(step, is_state_dict)

    threads = [threading.Thread(target=save, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_checkpoint_marker_moves_only_after_all_threads(paths: RunPaths) -> None:
    completed: list[tuple[int, bool]] = []
    monitor = CheckpointMonitor(paths, on_complete=lambda s, sd: completed.append((s, sd)))
    monitor.register_thread_count(3, checkpoint_thread_count=3)
    assert monitor.pending_steps() == [3]

    release = threading.Event()
    threads = _save_threads(monitor, 3, 2, is_state_dict=False, release=release)
    last = threading.Event()
    lone = _save_threads(monitor, 3, 1, is_state_dict=False, release=last)

    release.set()
    _join(threads)
    # two of three finished: the marker has not moved
    assert latest_checkpoint_step(paths) is None
    assert monitor.monitor_step(3, timeout=0.05) is False
    assert monitor.pending_steps() == [3]
    assert completed == []

    last.set()
    _join(lone)
    assert monitor.monitor_step(3, timeout=5) is True
    assert latest_checkpoint_step(paths) == 3
    assert latest_weights_version(paths) is None  # the state-dict marker is separate
    assert monitor.pending_steps() == []
    assert completed == [(3, False)]


def test_state_dict_and_checkpoint_markers_are_independent(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    monitor.register_thread_count(4, state_dict_thread_count=1, checkpoint_thread_count=2)

    sd_release, ckpt_release = threading.Event(), threading.Event()
    sd_threads = _save_threads(monitor, 4, 1, is_state_dict=True, release=sd_release)
    ckpt_threads = _save_threads(monitor, 4, 2, is_state_dict=False, release=ckpt_release)

    sd_release.set()
    _join(sd_threads)
    assert monitor.monitor_step(4, is_state_dict=True, timeout=5) is True
    assert latest_weights_version(paths) == 4
    assert latest_checkpoint_step(paths) is None
    assert monitor.monitor_step(4, is_state_dict=False, timeout=0.05) is False
    assert monitor.pending_steps() == [4]

    ckpt_release.set()
    _join(ckpt_threads)
    assert monitor.monitor_step(4, timeout=5) is True
    assert latest_checkpoint_step(paths) == 4
    assert monitor.pending_steps() == []


def test_monitor_step_waits_for_completion(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    monitor.register_thread_count(2, checkpoint_thread_count=1)
    release = threading.Event()
    threads = _save_threads(monitor, 2, 1, is_state_dict=False, release=release)

    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(monitor.monitor_step(2, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # still waiting for the save thread
    assert result == []

    release.set()
    waiter.join(10)
    _join(threads)
    assert result == [True]
    assert latest_checkpoint_step(paths) == 2


def test_monitor_step_of_unregistered_step_returns_at_once(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    assert monitor.monitor_step(7, timeout=0) is True
    assert monitor.monitor_step(7, is_state_dict=True, timeout=0) is True
    # registering zero threads registers nothing
    monitor.register_thread_count(7, state_dict_thread_count=0, checkpoint_thread_count=0)
    assert monitor.pending_steps() == []
    assert monitor.monitor_step(7, timeout=0) is True


def test_monitor_step_timeout(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    monitor.register_thread_count(5, checkpoint_thread_count=1)
    started = time.monotonic()
    assert monitor.monitor_step(5, timeout=0.2) is False
    assert time.monotonic() - started >= 0.15
    assert latest_checkpoint_step(paths) is None


def test_markers_never_move_backwards(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    monitor.register_thread_count(6, state_dict_thread_count=1, checkpoint_thread_count=1)
    monitor.register_thread_count(4, state_dict_thread_count=1, checkpoint_thread_count=1)

    for step in (6, 4):  # step 6 finishes before step 4
        for is_state_dict in (False, True):
            release = threading.Event()
            threads = _save_threads(monitor, step, 1, is_state_dict=is_state_dict, release=release)
            release.set()
            _join(threads)
        assert latest_checkpoint_step(paths) == 6
        assert latest_weights_version(paths) == 6

    assert monitor.pending_steps() == []
    monitor.update_latest_checkpoint_step(2)
    monitor.update_latest_state_dict_step(2)
    assert latest_checkpoint_step(paths) == 6
    assert latest_weights_version(paths) == 6
    monitor.update_latest_checkpoint_step(8)
    monitor.update_latest_state_dict_step(9)
    assert latest_checkpoint_step(paths) == 8
    assert latest_weights_version(paths) == 9


def test_steps_complete_out_of_order_with_concurrent_threads(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    steps = [1, 2, 3]
    for step in steps:
        monitor.register_thread_count(step, checkpoint_thread_count=3)
    releases = {step: threading.Event() for step in steps}
    threads = {
        step: _save_threads(monitor, step, 3, is_state_dict=False, release=releases[step])
        for step in steps
    }
    releases[2].set()
    _join(threads[2])
    assert latest_checkpoint_step(paths) == 2
    assert monitor.pending_steps() == [1, 3]
    releases[1].set()
    _join(threads[1])
    assert latest_checkpoint_step(paths) == 2  # 1 < 2: no move backwards
    releases[3].set()
    _join(threads[3])
    assert latest_checkpoint_step(paths) == 3
    assert monitor.pending_steps() == []


def test_too_many_notify_finished_raises(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    monitor.register_thread_count(3, checkpoint_thread_count=2, state_dict_thread_count=1)
    for _ in range(2):
        monitor.notify_started(3)
        monitor.notify_finished(3)
    monitor.notify_finished(3, is_state_dict=True)
    assert latest_checkpoint_step(paths) == 3
    assert latest_weights_version(paths) == 3
    # the step completed (its entry is gone): one finish more than registered is refused
    with pytest.raises((ValueError, KeyError), match="step 3"):
        monitor.notify_finished(3)
    with pytest.raises((ValueError, KeyError), match="step 3"):
        monitor.notify_finished(3, is_state_dict=True)
    assert latest_checkpoint_step(paths) == 3
    assert monitor.pending_steps() == []


def test_unregistered_notifications_raise(paths: RunPaths) -> None:
    monitor = CheckpointMonitor(paths)
    with pytest.raises(KeyError, match="checkpoint save threads of step 1"):
        monitor.notify_started(1)
    with pytest.raises(KeyError, match="state-dict save threads of step 1"):
        monitor.notify_finished(1, is_state_dict=True)
    with pytest.raises(ValueError, match=">= 0"):
        monitor.register_thread_count(1, checkpoint_thread_count=-1)
    assert latest_checkpoint_step(paths) is None
    assert latest_weights_version(paths) is None
