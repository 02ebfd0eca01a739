"""The engine service's files under the run root: the access token and the state file.

service/token        random secret, mode 0600; every control call must carry it
service/state.json   pids, process groups, machine, host, port, world size, config hash of
                     the service, the port of its collective weight sync's rendezvous
                     (written by rank 0, on whichever node it runs)
service/config.yaml  the resolved configuration the service was started with
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trinity_dagster.files import PRIVATE_MODE, write_text_atomic
from trinity_dagster.paths import RunPaths

MIN_TOKEN_CHARS = 32


class TokenFileError(PermissionError):
    """The token file is missing, too short, or readable by other users."""


def token_path(paths: RunPaths) -> Path:
    """Where the access token of this run's service lives."""
    return paths.service_token


def check_token(token: str, where: str) -> None:
    """Refuse an empty or short token (`where` names its source in the message)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(
            f"{where} has {len(token)} characters; a service token needs at least "
            f"{MIN_TOKEN_CHARS} (delete a bad token file: the next start writes a new one)"
        )


def ensure_token(paths: RunPaths) -> str:
    """The service token, created on first use (mode 0600 before the secret is written)."""
    path = token_path(paths)
    if not path.exists():
        write_text_atomic(path, secrets.token_urlsafe(32), mode=PRIVATE_MODE)
    return read_token(paths)


def read_token(paths: RunPaths) -> str:
    """The service token; refuses a token file that is too short or others can read."""
    path = token_path(paths)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TokenFileError(
            f"no service token at {path}: start the engine service first"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenFileError(
            f"service token {path} is accessible by other users (mode {oct(mode & 0o777)}); "
            "it must be 0600"
        )
    token = path.read_text().strip()
    check_token(token, f"service token {path}")
    return token


@dataclass(frozen=True)
class ServiceState:
    """What a running service publishes about itself."""

    pid: int  # rank 0
    pgid: int  # rank 0's process group (torchrun starts each rank in a session of its own)
    launcher_pid: int  # the torchrun agent (leader of its own process group), or rank 0 alone
    host: str
    port: int
    world_size: int
    config_hash: str
    log_file: str
    node: str = field(default_factory=socket.gethostname)  # the machine rank 0 runs on
    weight_sync_port: int | None = None  # the collective sync's rendezvous store (nccl)

    @property
    def is_local(self) -> bool:
        """Whether rank 0 runs on this machine, so that its pids mean something here."""
        return self.node == socket.gethostname()

    @property
    def url(self) -> str:
        """Base URL of the control API."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_host(bind_host: str) -> str:
    """The address clients reach a control API bound to `bind_host` at: this machine's name
    for a wildcard bind (rank 0 may land on any node), else `bind_host` itself."""
    return socket.getfqdn() if bind_host in WILDCARD_HOSTS else bind_host


def write_state(paths: RunPaths, state: ServiceState) -> None:
    """Publish the running service's address atomically."""
    text = json.dumps(asdict(state), indent=1)
    write_text_atomic(paths.service_state_file, text, mode=PRIVATE_MODE)


def read_state(paths: RunPaths) -> ServiceState | None:
    """The last published service state, or None."""
    try:
        data = json.loads(paths.service_state_file.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None
    try:
        return ServiceState(**data)
    except TypeError:  # written by another version: treat as stale
        return None


def clear_state(paths: RunPaths, pid: int | None = None) -> None:
    """Remove the state file (only if it still names `pid`, when given)."""
    current = read_state(paths)
    if current is not None and (pid is None or current.pid == pid):
        paths.service_state_file.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
