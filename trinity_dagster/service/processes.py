"""The processes of a running engine service (psutil): which are ours, which are frozen, kill.

A service is the agent (`launcher_pid`, `service/agent.py`), the ranks torchrun started
(each in a session of its own) and their children; a service of one rank is that rank alone
(`launcher_pid` is its own pid). The state file names the agent and rank 0; the other ranks
are found as the agent's descendants. A pid from the state file counts only while it still
runs our code, so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from trinity_dagster.service_api.state import ServiceState, pid_alive

AGENT_MODULE = "trinity_dagster.service.agent"
RANK_MODULE = "trinity_dagster.service.main"
FROZEN_STATUSES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
STOP_WAIT_S = 10.0


def _running(pid: int, module: str) -> psutil.Process | None:
    """The process `pid` if it runs `python -m module`, else None."""
    try:
        process = psutil.Process(pid)
        return process if module in process.cmdline() else None
    except psutil.Error:
        return None


def runs_rank(pid: int) -> bool:
    """Whether `pid` is an engine service rank (not some process that reused a dead pid)."""
    return _running(pid, RANK_MODULE) is not None


def process_tree(pid: int) -> list[psutil.Process]:
    """Process `pid` and its descendants, or nothing if it is gone."""
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def service_processes(state: ServiceState) -> list[psutil.Process]:
    """The agent, rank 0 and every descendant of the agent, as far as they still exist."""
    found: dict[int, psutil.Process] = {}
    agent = _running(state.launcher_pid, AGENT_MODULE)
    if agent is not None:
        found[agent.pid] = agent
        with contextlib.suppress(psutil.Error):
            found.update((child.pid, child) for child in agent.children(recursive=True))
    rank0 = _running(state.pid, RANK_MODULE)
    if rank0 is not None:
        found[rank0.pid] = rank0
    return list(found.values())


def frozen(processes: list[psutil.Process]) -> list[str]:
    """`pid N (stopped)` for each process that is stopped or held by a tracer."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            status = process.status()
            if status in FROZEN_STATUSES:
                found.append(f"pid {process.pid} ({status})")
    return found


def end_processes(processes: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM the processes' groups, SIGKILL what is left after `grace_s`; the pids ended.

    With `grace_s` 0 it is SIGKILL at once (a stopped process would not act on SIGTERM).
    Never signals the caller's own process group.
    """
    alive = processes
    if grace_s > 0:
        _signal_groups(alive, signal.SIGTERM)
        alive = _still_alive(alive, grace_s)
    _signal_groups(alive, signal.SIGKILL)
    left = {process.pid for process in _still_alive(alive, STOP_WAIT_S)}
    return sorted(process.pid for process in processes if process.pid not in left)


def _still_alive(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes that still exist (zombies count as gone) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = [process for process in processes if pid_alive(process.pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [process for process in alive if pid_alive(process.pid)]
    return alive


def _signal_groups(processes: list[psutil.Process], sig: signal.Signals) -> None:
    own_group = os.getpgrp()
    for process in processes:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            group = os.getpgid(process.pid)
            if group != own_group:
                os.killpg(group, sig)
            process.send_signal(sig)
