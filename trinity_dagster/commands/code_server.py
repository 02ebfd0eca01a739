"""The code servers `trinity-dagster run` starts itself, and the workspace it gives the daemon.

`dagster-daemon run` on a workspace of Python code locations starts a code server for each
and, every 60 s, starts a new one and drops the old (Dagster reloads code that may have
changed). The old server lives on while runs it launched are going, and a training's two
runs go on for the whole training: from the first minute on the run held two or three code
servers (over 200 MB each) and paid a fresh server's start (2-3 CPU-seconds) every minute.
The command starts one server per location instead, on a Unix socket, and hands the daemon a
workspace naming those sockets (as `dagster dev` does for its daemon): the daemon then
connects to them and starts none. Code changed while a training runs takes effect in the
next `trinity-dagster run`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trinity_dagster.commands.errors import TrainingRunError
from trinity_dagster.paths import RunPaths

# how long a code server may take to load the code location (Dagster's own default)
STARTUP_TIMEOUT_S = 180.0
POLL_S = 0.05


@dataclass
class CodeServers:
    """Code servers started for a run: their processes (each in its own session, with the
    run workers it starts), the daemon's workspace file naming them, and their sockets."""

    workspace: Path
    sockets_dir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    sockets: list[Path] = field(default_factory=list)


def workspace_origins(workspace: Path) -> list[Any]:
    """The code locations of `workspace`: Python code (`ManagedGrpcPythonEnvCodeLocationOrigin`)
    or existing gRPC servers (`GrpcServerCodeLocationOrigin`); any other kind is refused."""
    from dagster._core.remote_origin import (
        GrpcServerCodeLocationOrigin,
        ManagedGrpcPythonEnvCodeLocationOrigin,
    )
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    origins = WorkspaceFileTarget(paths=[str(workspace)]).create_origins()
    for origin in origins:
        if not isinstance(
            origin, (ManagedGrpcPythonEnvCodeLocationOrigin, GrpcServerCodeLocationOrigin)
        ):
            raise TrainingRunError(
                f"{workspace}: code location {origin.location_name!r} is neither Python code "
                "nor a gRPC server; trinity-dagster run serves only those"
            )
    return list(origins)


def grpc_entry(origin: Any) -> dict[str, Any]:
    """The workspace entry of an existing gRPC server `origin`, as the workspace gave it."""
    entry: dict[str, Any] = {"location_name": origin.location_name, "host": origin.host}
    for key in ("port", "socket"):
        if getattr(origin, key) is not None:
            entry[key] = getattr(origin, key)
    if origin.use_ssl:
        entry["ssl"] = True
    return {"grpc_server": entry}


def start_code_servers(paths: RunPaths, workspace: Path) -> CodeServers:
    """Start `dagster api grpc` for each Python code location of `workspace` (from its
    directory, with this process's environment, logging to `logs/code-server.log`) and write
    the daemon's workspace (`dagster_home/workspace.yaml`) naming them.

    The servers still load their code on return: `wait_until_serving` waits for that.
    """
    from dagster._core.remote_origin import GrpcServerCodeLocationOrigin

    origins = workspace_origins(workspace)
    # a Unix socket's path is limited to about 100 characters: not under the run root
    servers = CodeServers(
        workspace=paths.dagster_home / "workspace.yaml",
        sockets_dir=Path(tempfile.mkdtemp(prefix="trinity-dagster-")),
    )
    paths.logs.mkdir(parents=True, exist_ok=True)
    load_from = []
    for index, origin in enumerate(origins):
        if isinstance(origin, GrpcServerCodeLocationOrigin):
            load_from.append(grpc_entry(origin))
            continue
        name = origin.location_name
        sock = servers.sockets_dir / f"{index}.sock"
        command = [
            origin.loadable_target_origin.executable_path or sys.executable,
            *["-m", "dagster", "api", "grpc", "--lazy-load-user-code"],
            *["--socket", str(sock), "--location-name", name],
            *origin.loadable_target_origin.get_cli_args(),
        ]
        try:
            with open(paths.code_server_log, "ab") as log:
                process = subprocess.Popen(
                    command,
                    cwd=workspace.parent,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=os.environ.copy(),
                )
        except OSError:
            for started in servers.processes:  # the caller never gets them to stop
                started.kill()
            raise
        servers.processes.append(process)
        servers.sockets.append(sock)
        load_from.append({"grpc_server": {"socket": str(sock), "location_name": name}})
    servers.workspace.parent.mkdir(parents=True, exist_ok=True)
    servers.workspace.write_text(yaml.safe_dump({"load_from": load_from}, sort_keys=False))
    return servers


def serving(sock: Path) -> bool:
    """Whether a server accepts connections on Unix socket `sock` (it binds it once its
    code is loaded)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        try:
            client.connect(str(sock))
        except OSError:
            return False
    return True


def wait_until_serving(
    servers: CodeServers, paths: RunPaths, timeout_s: float = STARTUP_TIMEOUT_S
) -> None:
    """Return once every code server accepts connections; raise `TrainingRunError` naming
    the log if one exits first or none is up within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = list(zip(servers.processes, servers.sockets, strict=True))
    while waiting:
        process, sock = waiting[0]
        if process.poll() is not None:
            raise TrainingRunError(
                f"the Dagster code server exited with {process.returncode} while starting; "
                f"see {paths.code_server_log}"
            )
        if serving(sock):
            waiting.pop(0)
            continue
        if time.monotonic() > deadline:
            raise TrainingRunError(
                f"the Dagster code server did not start within {timeout_s:.0f} s; "
                f"see {paths.code_server_log}"
            )
        time.sleep(POLL_S)


def exited_code_server(servers: CodeServers) -> subprocess.Popen | None:
    """A code server of `servers` that has exited, if any."""
    return next((p for p in servers.processes if p.poll() is not None), None)


def remove_sockets(servers: CodeServers) -> None:
    """Remove the servers' socket directory (once they are stopped)."""
    shutil.rmtree(servers.sockets_dir, ignore_errors=True)
