"""The trainer hook's event thread: events logged in order, beside the caller, and a failure
to log reaches the caller."""

from __future__ import annotations

import threading

import pytest

from trinity_dagster.monitor.event_thread import EventThread


def test_events_run_in_order_on_another_thread_and_flush_waits_for_them() -> None:
    events = EventThread("test-events")
    release = threading.Event()
    logged: list[tuple[int, str]] = []

    def log(n: int) -> None:
        release.wait(5)
        logged.append((n, threading.current_thread().name))

    for n in range(20):
        events.submit(lambda n=n: log(n))
    assert logged == []  # the caller went on while the first event waits
    release.set()
    events.flush()
    assert logged == [(n, "test-events") for n in range(20)]
    events.close()
    assert not any(t.name == "test-events" for t in threading.enumerate())


def test_a_failure_to_log_is_raised_to_the_caller_and_later_events_are_dropped() -> None:
    events = EventThread("test-events")
    logged: list[int] = []

    def fail() -> None:
        raise OSError("database is locked")

    events.submit(lambda: logged.append(1))
    events.submit(fail)
    events.submit(lambda: logged.append(3))  # after the failure: not logged out of order
    with pytest.raises(RuntimeError, match="logging a Dagster event failed: database is locked"):
        events.flush()
    assert logged == [1]
    events.submit(fail)
    with pytest.raises(RuntimeError, match="database is locked"):
        events.close()
    assert not any(t.name == "test-events" for t in threading.enumerate())
