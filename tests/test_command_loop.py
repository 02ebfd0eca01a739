"""Rank 0's command loop: one command at a time, the reply before the housekeeping."""

from __future__ import annotations

import threading
import time
from typing import Any

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
