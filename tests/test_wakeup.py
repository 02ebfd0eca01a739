"""Wake-ups between the loops: a waiter returns when woken, sleeps its poll when not (long
when it listens, short when it cannot), and a waiter that cannot listen or has died costs
nothing but its poll; what lands wakes the side that waits for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trinity_dagster.handoff.end_of_data import mark_end_of_data
from trinity_dagster.handoff.sync_requests import answer_requests, pending_requests, request_sync
from trinity_dagster.handoff.wakeup import (
    EXPLORER,
    LISTENING_POLL_S,
    POLL_S,
    TRAINER,
    Wakeup,
    wake,
)
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import fill_buffer, tiny_config


def test_a_woken_waiter_returns_at_once_and_only_its_side_is_woken(short_tmp_path: Path) -> None:
    trainer = Wakeup(short_tmp_path, TRAINER, "loop")
    explorer = Wakeup(short_tmp_path, EXPLORER, "builtin")
    try:
        threading.Timer(0.2, wake, args=(short_tmp_path, TRAINER)).start()
        started = time.monotonic()
        trainer.wait(30.0)
        assert time.monotonic() - started < 10.0  # woken, not timed out
        started = time.monotonic()
        explorer.wait(0.3)  # the trainer's wake-up was not for it
        assert time.monotonic() - started >= 0.25
        wake(short_tmp_path, EXPLORER)
        wake(short_tmp_path, EXPLORER)
        explorer.wait(30.0)  # both wake-ups consumed at once
        started = time.monotonic()
        explorer.wait(0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        trainer.close()
        explorer.close()
    assert list(short_tmp_path.iterdir()) == []


def test_a_socket_path_too_long_falls_back_to_polling(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    waiter = Wakeup(deep, TRAINER, "loop")
    wake(deep, TRAINER)  # nothing listens: no error
    started = time.monotonic()
    waiter.wait(0.2)
    assert time.monotonic() - started >= 0.15
    assert not deep.exists()


def test_the_socket_of_a_waiter_that_died_is_removed_by_the_next_wake(short_tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from trinity_dagster.handoff.wakeup import EXPLORER, Wakeup\n"
        "Wakeup(Path(sys.argv[1]), EXPLORER, 'gone')\n"
        "print('listening', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(short_tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "listening\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(list(short_tmp_path.glob("explorer.*.sock"))) == 1
    wake(short_tmp_path, EXPLORER)
    assert list(short_tmp_path.glob("explorer.*.sock")) == []


def test_a_listening_waiter_polls_rarely_and_another_thread_can_end_its_wait(
    short_tmp_path: Path,
) -> None:
    waiter = Wakeup(short_tmp_path, TRAINER, "pin-ahead")
    deaf = Wakeup(short_tmp_path / ("d" * 120), TRAINER, "loop")
    try:
        assert waiter.poll_s == LISTENING_POLL_S > POLL_S == deaf.poll_s
        threading.Timer(0.2, waiter.interrupt).start()
        started = time.monotonic()
        waiter.wait(30.0)
        assert time.monotonic() - started < 10.0  # interrupted, not timed out
    finally:
        waiter.close()


def test_requests_answers_commits_and_the_end_of_data_wake_whom_they_concern(
    short_tmp_path: Path,
) -> None:
    config, _ = tiny_config(short_tmp_path)
    paths = RunPaths.of_config(config)
    trainer = Wakeup(paths.wakeup, TRAINER, "loop")
    explorer = Wakeup(paths.wakeup, EXPLORER, "builtin")
    assert trainer.poll_s == explorer.poll_s == LISTENING_POLL_S  # both listen
    try:
        for side, waiter, land in (
            (TRAINER, trainer, lambda: fill_buffer(config, 1, seed=1)),
            (TRAINER, trainer, lambda: request_sync(paths, "e0", have_version=0)),
            (EXPLORER, explorer, lambda: answer_requests(paths, pending_requests(paths))),
            (TRAINER, trainer, lambda: mark_end_of_data(paths, "e0", "done")),
        ):
            threading.Timer(0.2, land).start()
            started = time.monotonic()
            waiter.wait(60.0)
            assert time.monotonic() - started < 30.0, side  # woken, not timed out
    finally:
        trainer.close()
        explorer.close()
