"""The owner of an engine service: the process of the Dagster deployment that started it.

A service started from a run worker of `dagster dev` (or `dagster-daemon run`), or by
`trinity-dagster run`, belongs to that deployment. Once its owner has exited, the service
stops after `service.orphan_timeout_s` without commands instead of `service.idle_timeout_s`:
a deployment restarted within that time finds the service still warm, and one stopped for
good does not leave it running for the whole idle timeout. A service started by hand
(`trinity-dagster engine start`) has no owner.

The owner reaches the service's processes in the environment variable `OWNER_VARIABLE`,
as "pid:start time", so that a pid reused by another process never counts as the owner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

OWNER_VARIABLE = "TRINITY_DAGSTER_ENGINE_OWNER"

# Dagster's console scripts, and the modules its processes run with `python -m`
DAGSTER_SCRIPTS = frozenset({"dagster", "dagster-daemon", "dagster-webserver"})
DAGSTER_MODULES = frozenset({"dagster", "dagster._daemon", "dagster_webserver"})


@dataclass(frozen=True)
class Owner:
    """A process, told from any later process with its pid by its start time."""

    pid: int
    started_at: float

    @classmethod
    def of(cls, process: psutil.Process) -> Owner:
        """The owner `process`."""
        return cls(process.pid, round(process.create_time(), 2))

    def alive(self) -> bool:
        """Whether the owner still runs (a zombie counts as exited)."""
        try:
            process = psutil.Process(self.pid)
            return (
                round(process.create_time(), 2) == self.started_at
                and process.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False

    def to_env(self) -> str:
        """The value of `OWNER_VARIABLE` that names this owner."""
        return f"{self.pid}:{self.started_at}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Owner | None:
        """The owner named by `OWNER_VARIABLE` in `environ`, or None."""
        value = environ.get(OWNER_VARIABLE)
        if not value:
            return None
        pid, _, started_at = value.partition(":")
        try:
            return cls(int(pid), float(started_at))
        except ValueError as err:
            raise ValueError(
                f"{OWNER_VARIABLE}={value!r} is not 'pid:start time' (set by the engine "
                "service's launcher)"
            ) from err


def runs_dagster(cmdline: list[str]) -> bool:
    """Whether a command line runs Dagster: one of its console scripts, or
    `python -m dagster...`, in its first three words (the arguments do not count)."""
    head = cmdline[:3]
    for index, word in enumerate(head):
        if Path(word).name in DAGSTER_SCRIPTS:
            return True
        if word == "-m" and index + 1 < len(cmdline) and cmdline[index + 1] in DAGSTER_MODULES:
            return True
    return False


def dagster_deployment(process: psutil.Process | None = None) -> Owner | None:
    """The outermost Dagster process of the chain of Dagster processes that `process`
    (default: this one) runs in: `dagster dev`, or the `dagster-daemon` that launched the
    run. `process` itself may be a step's worker that Dagster started with `multiprocessing`.
    None when no ancestor runs Dagster (a test, `dagster.materialize` in a script)."""
    current: psutil.Process | None = process or psutil.Process(os.getpid())
    found: psutil.Process | None = None
    while current is not None:
        if _runs_dagster_too(current):
            found = current
        elif found is not None:
            break  # the first process above the chain
        try:
            current = current.parent()
        except psutil.Error:
            break
    try:
        return None if found is None else Owner.of(found)
    except psutil.Error:  # gone meanwhile
        return None


def _runs_dagster_too(process: psutil.Process) -> bool:
    """Whether `process` still exists, can be read and runs Dagster."""
    try:
        return runs_dagster(process.cmdline())
    except psutil.Error:
        return False


def this_process() -> Owner:
    """This process as an owner."""
    return Owner.of(psutil.Process(os.getpid()))
