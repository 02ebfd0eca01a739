"""Start, find, attach to and stop the engine service of a run (no torch in this process).

The service runs under torchrun with the configuration's world size (an engine of one rank
on one node runs alone, without torchrun's agent), detached in its own process group, logging
to `logs/engine.log`. One run root has at most one service: starts are serialised with a lock
file, and a state file naming a dead or silent process is stale and replaced.

On N nodes (`service.nnodes`), `start_service` starts this machine's agent and waits until
the other nodes have joined (`join_service`, `trinity-dagster engine join`) and rank 0,
on whichever node the rendezvous put it, has published the state file. A state file of a
rank 0 on another machine is judged by whether it answers: its pids mean nothing here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from trinity_dagster.config import ConfigError, TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.owner import Owner, claim
from trinity_dagster.service.processes import (
    AGENT_MODULE,
    RANK_MODULE,
    end_processes,
    frozen,
    process_tree,
    runs_rank,
    service_processes,
)
from trinity_dagster.service_api.client import EngineClient, EngineError, EngineUnreachable
from trinity_dagster.service_api.state import (
    ServiceState,
    clear_state,
    ensure_token,
    pid_alive,
    read_state,
    read_token,
)

# what torchrun gives its ranks and a rank reads (engine/parallel.py)
LAUNCHER_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
SILENT_AFTER_S = 10.0  # `status` is answered from a snapshot, even while a step trains
STOP_GRACE_S = 10.0

log = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    """The engine service did not come up; the message holds the end of its log."""


@dataclass(frozen=True)
class SilentService:
    """A service whose processes exist but that does not answer (stopped, hung)."""

    state: ServiceState
    reason: str


def log_path(paths: RunPaths) -> Path:
    """The service's log file."""
    return paths.engine_log


def _client(state: ServiceState, paths: RunPaths, timeout_s: float) -> EngineClient:
    return EngineClient(state.url, read_token(paths), timeout_s=timeout_s)


def find_service(paths: RunPaths) -> ServiceState | SilentService | None:
    """This run root's service: answering, silent, or None (a stale state file is cleared)."""
    state = read_state(paths)
    if state is None:
        return None
    if state.is_local and not (pid_alive(state.pid) and runs_rank(state.pid)):
        clear_state(paths, state.pid)
        return None
    stopped = frozen(_local_processes(state))
    if stopped:
        return SilentService(state, f"its processes are stopped: {', '.join(stopped)}")
    token = read_token(paths)  # a bad token file is the caller's problem, not the service's
    try:
        with EngineClient(state.url, token, timeout_s=SILENT_AFTER_S) as client:
            client.status()
    except (EngineUnreachable, EngineError, OSError) as err:
        where = "" if state.is_local else f" on {state.node}"
        return SilentService(state, f"rank 0 (pid {state.pid}{where}) does not answer: {err}")
    return state


def _local_processes(state: ServiceState) -> list[psutil.Process]:
    """The service's processes on this machine (none when rank 0 runs on another one)."""
    return service_processes(state) if state.is_local else []


def replace_silent(paths: RunPaths, silent: SilentService) -> list[int]:
    """SIGKILL a silent service's processes here and clear its state file; the pids killed."""
    killed = end_processes(_local_processes(silent.state), grace_s=0)
    clear_state(paths, silent.state.pid)
    return killed


def live_service(paths: RunPaths) -> ServiceState | None:
    """The running service of this run root that answers `status`, or None.

    A silent service is killed and its state file cleared, so that a new one can start.
    """
    found = find_service(paths)
    if isinstance(found, SilentService):
        killed = replace_silent(paths, found)
        log.warning(
            "killed the silent engine service of %s (%s): pids %s", paths.root, found.reason, killed
        )
        return None
    return found


@contextlib.contextmanager
def _start_lock(paths: RunPaths) -> Iterator[None]:
    paths.service.mkdir(parents=True, exist_ok=True)
    with open(paths.service_start_lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def rendezvous_id(config: TrinityConfig) -> str:
    """The c10d rendezvous id: the same on every node started with this configuration."""
    return f"trinity-dagster-{config.resolved_hash()}"


def torchrun_options(config: TrinityConfig, node_rank: int | None = None) -> list[str]:
    """torchrun's options for one node, or for one of N nodes meeting through c10d.

    `node_rank` 0 hosts the rendezvous store, another only connects to it; None leaves that
    to torchrun (the node that the endpoint names hosts it).
    """
    service = config.service
    world_size = config.megatron.world_size
    if service.nnodes == 1:
        return [f"--nproc_per_node={world_size}", "--nnodes=1"]
    options = [
        f"--nnodes={service.nnodes}",
        f"--nproc-per-node={service.procs_per_node(world_size)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={service.rdzv_endpoint}",
        f"--rdzv-id={rendezvous_id(config)}",
    ]
    if node_rank is not None:
        options.append(f"--rdzv-conf=is_host={str(node_rank == 0).lower()}")
    return options


def launch_command(
    config_file: Path, config: TrinityConfig, node_rank: int | None = None
) -> list[str]:
    """The command line of this node's agent (see `agent.py`) and its ranks; of the rank
    alone for an engine of one rank (no agent: one torch process fewer, ~180 MB)."""
    rank = ["-m", RANK_MODULE, "-c", str(config_file)]
    if runs_alone(config):
        return [sys.executable, *rank]
    return [sys.executable, "-m", AGENT_MODULE, *torchrun_options(config, node_rank), *rank]


def runs_alone(config: TrinityConfig) -> bool:
    """Whether the service is one rank on one node, started without torchrun."""
    return config.service.nnodes == 1 and config.megatron.world_size == 1


def _rank_environment(config: TrinityConfig) -> dict[str, str]:
    """The environment of the service's processes; a rank started alone gets none of a
    launcher's variables this process may have, so it runs as a single process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if runs_alone(config):
        for name in LAUNCHER_VARIABLES:
            env.pop(name, None)
    return env


def join_service(config: TrinityConfig, config_file: Path, node_rank: int | None) -> int:
    """Run this node's agent of an N-node service in the foreground; its exit status.

    `node_rank` None: the configuration's `service.node_rank`.
    """
    service = config.service
    if service.nnodes == 1:
        raise ConfigError(
            f"service.nnodes is 1 in {config_file}: a one-node service starts with "
            "`trinity-dagster engine start`; joining needs service.nnodes > 1"
        )
    rank = service.node_rank if node_rank is None else node_rank
    if rank is not None and not 0 <= rank < service.nnodes:
        raise ConfigError(f"node rank {rank} is outside 0..{service.nnodes - 1} (service.nnodes)")
    command = launch_command(config_file.resolve(), config, rank)
    return subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode


def start_service(
    config: TrinityConfig,
    launched: Callable[[], None] = lambda: None,
    *,
    owner: Owner | None = None,
) -> ServiceState:
    """The running service of this run, started if none answers. `launched` is called once
    this call has started the service's processes or found it running (or failed before),
    before it waits for a start to finish. The service, started here or found running,
    then belongs to `owner` (`service/owner.py`); without one, a service found running
    keeps its owner and one started here has none."""
    paths = RunPaths.of_config(config)
    with _start_lock(paths):
        try:
            state = live_service(paths)
            if state is not None:
                if owner is not None:
                    claim(paths, owner)
                return state
            claim(paths, owner)
            ensure_token(paths)
            config_file = paths.service_config
            config_file.write_text(config.to_yaml())
            paths.logs.mkdir(parents=True, exist_ok=True)
            log = log_path(paths)
            offset = log.stat().st_size if log.exists() else 0
            with open(log, "ab") as log_handle:
                process = subprocess.Popen(
                    launch_command(config_file, config, config.service.node_rank),
                    stdin=subprocess.DEVNULL,
                    stdout=log_handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=_rank_environment(config),
                )
            # reap the process when it exits, so this process never keeps a zombie around
            threading.Thread(target=process.wait, daemon=True).start()
        finally:
            launched()
        return _wait_until_up(paths, process, config, log, offset)


def _started_by(state: ServiceState, process: subprocess.Popen, nnodes: int) -> bool:
    """Whether `state` is of the service that `process` started.

    On N nodes rank 0 may run under another node's agent; no state file existed when this
    one started (the start lock is held), so the first one published is this service's.
    """
    return nnodes > 1 or state.launcher_pid == process.pid


def _wait_until_up(
    paths: RunPaths, process: subprocess.Popen, config: TrinityConfig, log: Path, offset: int
) -> ServiceState:
    timeout_s = config.service.start_timeout_s
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceStartError(
                f"engine service exited with code {process.returncode} while starting; "
                f"end of {log}:\n{_log_tail(log, offset)}"
            )
        state = read_state(paths)
        if state is not None and _started_by(state, process, config.service.nnodes):
            return state
        time.sleep(0.2)
    end_processes(process_tree(process.pid), grace_s=STOP_GRACE_S)
    raise ServiceStartError(
        f"engine service did not answer within {timeout_s:.0f} s{_waiting_for(config)}; "
        f"end of {log}:\n{_log_tail(log, offset)}"
    )


def _waiting_for(config: TrinityConfig) -> str:
    """What an N-node start waits for, for its timeout message ('' on one node)."""
    service = config.service
    if service.nnodes == 1:
        return ""
    return (
        f" (it waits for all {service.nnodes} nodes at {service.rdzv_endpoint}: run "
        "`trinity-dagster engine join -c CONFIG --node-rank K` on each other node)"
    )


def _log_tail(log: Path, offset: int, lines: int = 40) -> str:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def connect(
    config: TrinityConfig, *, autostart: bool = True, owner: Owner | None = None
) -> EngineClient:
    """A client of this run's service, starting the service first (for `owner`) if allowed
    and needed."""
    paths = RunPaths.of_config(config)
    found = start_service(config, owner=owner) if autostart else find_service(paths)
    if isinstance(found, SilentService):
        raise EngineUnreachable(
            f"the engine service of {paths.root} does not answer ({found.reason}); "
            "`trinity-dagster engine start -c CONFIG` replaces it"
        )
    if found is None:
        raise EngineUnreachable(
            f"no engine service runs for {paths.root}; start one with "
            "`trinity-dagster engine start -c CONFIG`"
        )
    return _client(found, paths, config.service.request_timeout_s)


def stop_service(paths: RunPaths, timeout_s: float = 120.0) -> bool:
    """Shut the service down cleanly (pending saves finish); kill it if it won't go.

    A silent service is killed at once. Returns whether there was a service to stop.
    """
    state = read_state(paths)
    if state is None:
        return False
    found = find_service(paths)
    if isinstance(found, ServiceState):
        _shut_down(found, paths, timeout_s)
    grace_s = 0 if isinstance(found, SilentService) else STOP_GRACE_S
    end_processes(_local_processes(state), grace_s=grace_s)
    clear_state(paths, state.pid)
    return True


def _shut_down(state: ServiceState, paths: RunPaths, timeout_s: float) -> None:
    """Ask the service to exit and wait (up to `timeout_s`) until rank 0 is gone."""
    try:
        with _client(state, paths, timeout_s=timeout_s) as client:
            client.shutdown()
    except (EngineUnreachable, EngineError, OSError):
        pass
    deadline = time.monotonic() + timeout_s
    while _rank0_runs(state, paths) and time.monotonic() < deadline:
        time.sleep(0.2)


def _rank0_runs(state: ServiceState, paths: RunPaths) -> bool:
    """Whether rank 0 or its agent still runs (here: by pid, so that a clean shutdown lets
    the agent exit by itself; on another machine: while rank 0's state file is there)."""
    if state.is_local:
        return pid_alive(state.pid) or pid_alive(state.launcher_pid)
    return read_state(paths) == state  # rank 0 removes its state file as it exits
