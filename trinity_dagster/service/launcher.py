"""Start, find, attach to and stop the engine service of a run (no torch in this process).

The service runs under torchrun with the configuration's world size, detached in its own
process group, logging to `logs/engine.log`. One run root has at most one service: starts
are serialised with a lock file, and a state file naming a dead or silent process is stale
and replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.client import EngineClient, EngineError, EngineUnreachable
from trinity_dagster.service.state import (
    CONFIG_FILE,
    ServiceState,
    clear_state,
    ensure_token,
    pid_alive,
    read_state,
    read_token,
)

LOG_FILE = "engine.log"


class ServiceStartError(RuntimeError):
    """The engine service did not come up; the message holds the end of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_path(paths: RunPaths) -> Path:
    """The service's log file."""
    return paths.logs / LOG_FILE


def _client(state: ServiceState, paths: RunPaths, timeout_s: float) -> EngineClient:
    return EngineClient(state.url, read_token(paths), timeout_s=timeout_s)


def live_service(paths: RunPaths) -> ServiceState | None:
    """The running service of this run root that answers `status`, or None (stale state cleared)."""
    state = read_state(paths)
    if state is None:
        return None
    if pid_alive(state.pid):
        try:
            with _client(state, paths, timeout_s=10) as client:
                client.status()
            return state
        except (EngineUnreachable, EngineError, OSError):
            pass
        # alive but silent: a hung or half-dead service
        _kill_service(state)
    clear_state(paths, state.pid)
    return None


def _kill_service(state: ServiceState) -> None:
    """Stop the torchrun agent (it stops its ranks), then make sure rank 0 is gone too."""
    _kill_group(state.launcher_pid)
    _kill_group(state.pgid)


def _kill_group(pgid: int) -> None:
    """SIGTERM the process group whose leader is `pgid`, then SIGKILL it if it stays."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while pid_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_alive(pgid):
            return


@contextlib.contextmanager
def _start_lock(paths: RunPaths) -> Iterator[None]:
    paths.service.mkdir(parents=True, exist_ok=True)
    with open(paths.service / "start.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def launch_command(config_file: Path, world_size: int, master_port: int) -> list[str]:
    """The torchrun command line of the service."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port}",
        "-m",
        "trinity_dagster.service.main",
        "-c",
        str(config_file),
    ]


def start_service(config: TrinityConfig) -> ServiceState:
    """The running service of this run, started if none answers."""
    paths = RunPaths.of(config.run_root)
    with _start_lock(paths):
        state = live_service(paths)
        if state is not None:
            return state
        ensure_token(paths)
        config_file = paths.service / CONFIG_FILE
        config_file.write_text(config.to_yaml())
        paths.logs.mkdir(parents=True, exist_ok=True)
        log = log_path(paths)
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as log_handle:
            process = subprocess.Popen(
                launch_command(config_file, config.megatron.world_size, free_port()),
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        # reap the agent when it exits, so this process never keeps a zombie around
        threading.Thread(target=process.wait, daemon=True).start()
        return _wait_until_up(paths, process, config.service.start_timeout_s, log, offset)


def _wait_until_up(
    paths: RunPaths, process: subprocess.Popen, timeout_s: float, log: Path, offset: int
) -> ServiceState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceStartError(
                f"engine service exited with code {process.returncode} while starting; "
                f"end of {log}:\n{_log_tail(log, offset)}"
            )
        state = read_state(paths)
        if state is not None and state.launcher_pid == process.pid:
            return state
        time.sleep(0.2)
    _kill_group(process.pid)
    raise ServiceStartError(
        f"engine service did not answer within {timeout_s:.0f} s; end of {log}:\n"
        f"{_log_tail(log, offset)}"
    )


def _log_tail(log: Path, offset: int, lines: int = 40) -> str:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def connect(config: TrinityConfig, *, autostart: bool = True) -> EngineClient:
    """A client of this run's service, starting the service first if allowed and needed."""
    paths = RunPaths.of(config.run_root)
    state = start_service(config) if autostart else live_service(paths)
    if state is None:
        raise EngineUnreachable(
            f"no engine service runs for {paths.root}; start one with "
            "`trinity-dagster engine start -c CONFIG`"
        )
    return _client(state, paths, config.service.request_timeout_s)


def stop_service(paths: RunPaths, timeout_s: float = 120.0) -> bool:
    """Shut the service down cleanly (pending saves finish); kill it if it won't go."""
    state = read_state(paths)
    if state is None:
        return False
    if pid_alive(state.pid):
        try:
            with _client(state, paths, timeout_s=timeout_s) as client:
                client.shutdown()
        except (EngineUnreachable, EngineError, OSError):
            pass
        deadline = time.monotonic() + timeout_s
        while pid_alive(state.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    _kill_service(state)
    clear_state(paths, state.pid)
    return True
