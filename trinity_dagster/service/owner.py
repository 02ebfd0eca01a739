"""The owner of an engine service: the process of the Dagster deployment that uses it.

A service started from a run worker of `dagster dev` (or `dagster-daemon run`), or by
`trinity-dagster run`, belongs to that deployment, and so does a running service such a
deployment attaches to: the last one to claim it owns it (`claim`). Once its owner has
exited, the service stops after `service.orphan_timeout_s` without commands instead of
`service.idle_timeout_s`: a deployment restarted within that time finds the service still
warm, and one stopped for good does not leave it running for the whole idle timeout. A
service started by hand (`trinity-dagster engine start`) has no owner until a deployment
attaches to it.

The owner is a small file under `service/` (`RunPaths.service_owner`): its pid, start time
(so that a pid reused by another process never counts as the owner) and host (a rank 0 on
another node of a multi-node service cannot see the process, and ignores it).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from trinity_dagster.files import PRIVATE_MODE, write_text_atomic
from trinity_dagster.paths import RunPaths

# Dagster's console scripts, and the modules its processes run with `python -m`
DAGSTER_SCRIPTS = frozenset({"dagster", "dagster-daemon", "dagster-webserver"})
DAGSTER_MODULES = frozenset({"dagster", "dagster._daemon", "dagster_webserver"})


@dataclass(frozen=True)
class Owner:
    """A process on a host, told from any later process with its pid by its start time."""

    pid: int
    started_at: float
    host: str

    @classmethod
    def of(cls, process: psutil.Process) -> Owner:
        """The owner `process` (of this host)."""
        return cls(process.pid, round(process.create_time(), 2), socket.gethostname())

    def alive(self) -> bool:
        """Whether the owner still runs (a zombie counts as exited); only asked on its host."""
        try:
            process = psutil.Process(self.pid)
            return (
                round(process.create_time(), 2) == self.started_at
                and process.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False


def claim(paths: RunPaths, owner: Owner | None) -> None:
    """Make `owner` the owner of the run's engine service (None: no owner). Not fsynced: it
    names a live process, which a reboot ends anyway."""
    if owner is None:
        paths.service_owner.unlink(missing_ok=True)
        return
    paths.service.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(owner))
    write_text_atomic(paths.service_owner, text, mode=PRIVATE_MODE, fsync=False)


def recorded_owner(paths: RunPaths) -> Owner | None:
    """The owner the run's engine service's claim names, on any host (None: no claim, or a
    file that does not describe an owner)."""
    try:
        data = json.loads(paths.service_owner.read_text())
        return Owner(int(data["pid"]), float(data["started_at"]), str(data["host"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def current_owner(paths: RunPaths) -> Owner | None:
    """The owner of the run's engine service if it is a process of this host, else None."""
    owner = recorded_owner(paths)
    return owner if owner is not None and owner.host == socket.gethostname() else None


def owner_report(paths: RunPaths) -> dict[str, object] | None:
    """The owner of the run's engine service as `trinity-dagster engine status` shows it:
    pid, host, start time (Unix seconds) and whether it still runs (None when it is on
    another host, where it cannot be seen); None when the service has no owner."""
    owner = recorded_owner(paths)
    if owner is None:
        return None
    here = owner.host == socket.gethostname()
    return {**asdict(owner), "alive": owner.alive() if here else None}


def orphaned(paths: RunPaths) -> bool:
    """Whether the run's engine service has an owner on this host and it has exited."""
    owner = current_owner(paths)
    return owner is not None and not owner.alive()


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
        if _is_dagster_process(current):
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


def _is_dagster_process(process: psutil.Process) -> bool:
    """Whether `process` still exists, can be read and runs Dagster."""
    try:
        return runs_dagster(process.cmdline())
    except psutil.Error:
        return False


def this_process() -> Owner:
    """This process as an owner."""
    return Owner.of(psutil.Process(os.getpid()))
