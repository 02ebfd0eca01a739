"""Rank 0's command loop: one command at a time, the reply before the housekeeping; an
idle service stops sooner once its owner has exited."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from trinity_dagster.service.owner import Owner, this_process
from trinity_dagster.service.server import SHUTDOWN, CommandBus, rank0_loop

OPS = ("publish_weights", "train_step")


class _RecordingHost:
    """A host that records what the loop asks of it; its housekeeping waits until the caller
    holds the answer of the command before it."""

    def __init__(self, bus: CommandBus, answers: list[dict[str, Any]]) -> None:
        self.bus = bus
        self.answers = answers
        self.events: list[str] = []

    def execute(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.events.append(f"execute {op}")
        return {"op": op}

    def after_reply(self) -> None:
        replied = sum(event.startswith("execute") for event in self.events)
        deadline = time.monotonic() + 10
        while len(self.answers) < replied:
            assert time.monotonic() < deadline, "the housekeeping ran before the reply"
            time.sleep(0.001)
        self.events.append("after_reply")
        if replied == len(OPS):
            self.bus.request_shutdown()

    def status(self) -> dict[str, Any]:
        return {}

    def poll(self) -> None:
        self.events.append("poll")

    def has_pending_saves(self) -> bool:
        return False

    def broadcast(self, command: dict[str, Any] | None) -> dict[str, Any]:
        assert command is not None
        return command

    def close(self) -> None:
        pass


def test_housekeeping_runs_after_the_reply_and_before_the_next_command() -> None:
    bus = CommandBus()
    answers: list[dict[str, Any]] = []
    host = _RecordingHost(bus, answers)
    caller = threading.Thread(target=lambda: [answers.append(bus.submit(op, {}, 10)) for op in OPS])
    caller.start()
    assert rank0_loop(host, bus, idle_timeout_s=60) == SHUTDOWN
    caller.join(timeout=10)
    assert answers == [{"op": op} for op in OPS]
    assert host.events == [
        "execute publish_weights",
        "after_reply",
        "execute train_step",
        "after_reply",
    ]


class _IdleHost(_RecordingHost):
    """A host with no commands to run, that records what rank 0 broadcasts."""

    def broadcast(self, command: dict[str, Any] | None) -> dict[str, Any]:
        assert command is not None
        self.events.append(command["op"])
        return command


def _idle_loop(owner: Owner, *, orphan_timeout_s: float, idle_timeout_s: float = 60) -> str:
    host = _IdleHost(CommandBus(), [])
    reason = rank0_loop(
        host,
        host.bus,
        idle_timeout_s,
        orphan_timeout_s=orphan_timeout_s,
        orphaned=lambda: not owner.alive(),
    )
    assert host.events == [SHUTDOWN]  # the other ranks are told to stop too
    return reason


def test_an_idle_service_whose_owner_exited_stops_after_the_orphan_timeout() -> None:
    owner_process = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = Owner.of(psutil.Process(owner_process.pid))
    owner_process.wait()
    started = time.monotonic()
    assert _idle_loop(owner, orphan_timeout_s=0.2) == "orphaned"
    assert time.monotonic() - started < 5


def test_an_idle_service_whose_owner_runs_waits_for_the_idle_timeout() -> None:
    owner = this_process()  # alive all along: the orphan timeout never applies
    started = time.monotonic()
    assert _idle_loop(owner, orphan_timeout_s=0.1, idle_timeout_s=1.2) == "idle"
    assert time.monotonic() - started >= 1.2
