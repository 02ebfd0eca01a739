"""The control API (FastAPI on uvicorn) of rank 0 and the command loop of every rank.

HTTP handlers never touch the engine: they validate the JSON request, put a command on a
queue and wait for its result. The main thread of rank 0 takes commands one at a time,
broadcasts each to the other ranks, and runs it on its own engine host, so commands run in
order, one at a time, on all ranks together. `status` is answered from a snapshot, even
while a step trains.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    BaseUser,
    SimpleUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection

from trinity_dagster.config import is_loopback_host
from trinity_dagster.service_api.protocol import (
    TOKEN_HEADER,
    CommandError,
    SaveCheckpointRequest,
    StepConflictError,
    TrainStepRequest,
    WeightsStepRequest,
    WeightsTransferRequest,
    error_payload,
)
from trinity_dagster.service_api.state import check_token

log = logging.getLogger(__name__)

HEARTBEAT_S = 60.0
SHUTDOWN = "shutdown"
NOOP = "noop"
POLL = "poll"
MAX_BODY_BYTES = 64 * 1024  # requests are a few small JSON fields


class Host(Protocol):
    """What the command loop needs of the per-rank engine host."""

    def execute(self, op: str, args: dict[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def poll(self) -> None: ...

    def has_pending_saves(self) -> bool: ...

    def after_reply(self) -> None: ...

    def broadcast(self, command: dict[str, Any] | None) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class _Command:
    op: str
    args: dict[str, Any]
    future: Future = field(default_factory=Future)


class CommandBus:
    """Commands from HTTP handler threads to rank 0's main thread, one at a time."""

    def __init__(self) -> None:
        self._queue: queue.Queue[_Command] = queue.Queue()
        self.busy_with: str | None = None

    def submit(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Queue a command and wait for its result (raises what the command raised)."""
        command = _Command(op, args)
        self._queue.put(command)
        return command.future.result(timeout=timeout)

    def request_shutdown(self) -> None:
        """Ask the main loop to shut down (e.g. on SIGTERM) without waiting for it."""
        self._queue.put(_Command(SHUTDOWN, {}))

    def take(self, timeout: float) -> _Command | None:
        """The next command, or None after `timeout` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


def check_bind_host(host: str, allow_non_loopback: bool) -> None:
    """Refuse a non-loopback bind address unless explicitly allowed."""
    if not (is_loopback_host(host) or allow_non_loopback):
        raise PermissionError(
            f"refusing to bind the control API to non-loopback address {host!r}; "
            "set service.allow_non_loopback: true to allow it"
        )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    sock.set_inheritable(False)
    return sock


class BearerToken(AuthenticationBackend):
    """Admits a request only if it carries `Authorization: Bearer <the service token>`."""

    def __init__(self, token: str) -> None:
        check_token(token, "the control API's token")
        self._expected = f"Bearer {token}".encode()

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser]:
        """Credentials of a request with the right token; raises for any other request."""
        given = conn.headers.get(TOKEN_HEADER, "").encode()
        if not secrets.compare_digest(given, self._expected):
            raise AuthenticationError("missing or wrong service token")
        return AuthCredentials(["control"]), SimpleUser("trainer")


def _refuse_unauthenticated(_: HTTPConnection, err: AuthenticationError) -> JSONResponse:
    return JSONResponse(
        status_code=401,
        content=error_payload(err, ""),
        headers={"WWW-Authenticate": "Bearer"},
    )


def _invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
        for problem in err.errors()
    )
    message = f"invalid request to {request.url.path}: {problems}"
    return JSONResponse(status_code=422, content={**error_payload(err, ""), "error": message})


Transfers = Callable[[int, str], dict[str, Any]]


def build_app(
    bus: CommandBus,
    token: str,
    status: Callable[[], dict[str, Any]],
    timeout: float,
    transfers: Transfers | None = None,
) -> FastAPI:
    """The FastAPI application of the control API.

    The token is checked before anything reads a request (unauthenticated bodies are never
    read), bodies over `MAX_BODY_BYTES` get 413, and only JSON bodies are accepted.
    `transfers(version, receiver)` starts a collective weights transfer (sync_method `nccl`);
    it runs beside the command loop, so an explorer is served while a step trains.
    """
    app = FastAPI(
        title="trinity-dagster engine service",
        docs_url=None,
        redoc_url=None,
        max_body_size=MAX_BODY_BYTES,
    )
    app.add_middleware(
        AuthenticationMiddleware, backend=BearerToken(token), on_error=_refuse_unauthenticated
    )
    app.exception_handler(RequestValidationError)(_invalid_request)

    @app.exception_handler(CommandError)
    def command_error(_: Request, err: CommandError) -> JSONResponse:
        return JSONResponse(status_code=err.status, content=error_payload(err, err.traceback_text))

    def run(op: str, args: dict[str, Any]) -> dict[str, Any]:
        return bus.submit(op, args, timeout)

    @app.get("/status")
    def get_status() -> dict[str, Any]:
        return {**status(), "busy_with": bus.busy_with}

    @app.post("/train_step")
    def train_step(req: TrainStepRequest) -> dict[str, Any]:
        return run("train_step", req.model_dump())

    @app.post("/save_checkpoint")
    def save_checkpoint(req: SaveCheckpointRequest) -> dict[str, Any]:
        return run("save_checkpoint", req.model_dump())

    @app.post("/publish_weights")
    def publish_weights(req: WeightsStepRequest) -> dict[str, Any]:
        return run("publish_weights", req.model_dump())

    @app.post("/upload_weights")
    def upload_weights(req: WeightsStepRequest) -> dict[str, Any]:
        return run("upload_weights", req.model_dump())

    @app.post("/stage_weights")
    def stage_weights(req: WeightsStepRequest) -> dict[str, Any]:
        return run("stage_weights", req.model_dump())

    @app.post("/weights/transfer")
    def weights_transfer(req: WeightsTransferRequest) -> dict[str, Any]:
        if transfers is None:
            raise StepConflictError(
                "this engine service does not send weights over a collective "
                "(synchronizer.sync_method is not nccl)"
            )
        try:
            return transfers(req.version, req.receiver)
        except LookupError as err:
            raise StepConflictError(str(err)) from err

    @app.post("/shutdown")
    def shutdown() -> dict[str, Any]:
        return run(SHUTDOWN, {})

    return app


class ControlServer:
    """uvicorn serving the control API in a background thread of rank 0."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )

    def start(self) -> None:
        """Serve in the background; returns once the server accepts requests."""
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("control API did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving (after the reply in flight has been sent)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


def run_command(host: Host, command: dict[str, Any]) -> dict[str, Any]:
    """Run one command on this rank's host; errors become `CommandError` with the traceback."""
    try:
        return host.execute(command["op"], command["args"])
    except CommandError as err:
        if not err.traceback_text:
            err.traceback_text = traceback.format_exc()
        raise
    except Exception as err:
        wrapped = CommandError(f"{type(err).__name__}: {err}", traceback.format_exc())
        raise wrapped from err


def rank0_loop(
    host: Host,
    bus: CommandBus,
    idle_timeout_s: float,
    *,
    orphan_timeout_s: float = float("inf"),
    orphaned: Callable[[], bool] = lambda: False,
) -> str:
    """Rank 0's main loop; returns why it ended (`shutdown`, `idle`, or `orphaned`: no
    command came for `orphan_timeout_s` and `orphaned()` says the service's owner exited)."""
    last_command = time.monotonic()
    last_broadcast = last_command
    while True:
        if host.has_pending_saves():  # finalizing is collective: every rank polls together
            host.broadcast({"op": POLL, "args": {}})
            host.poll()
        command = bus.take(timeout=0.5)
        now = time.monotonic()
        if command is None:
            idle_s = now - last_command
            stop = "idle" if idle_s > idle_timeout_s else None
            if stop is None and idle_s > orphan_timeout_s and orphaned():
                stop = "orphaned"
            if stop is not None:
                host.broadcast({"op": SHUTDOWN, "args": {}})
                return stop
            if now - last_broadcast > HEARTBEAT_S:
                host.broadcast({"op": NOOP, "args": {}})
                last_broadcast = now
            continue
        last_command = last_broadcast = now
        message = {"op": command.op, "args": command.args}
        host.broadcast(message)
        if command.op == SHUTDOWN:
            command.future.set_result({"shutting_down": True})
            return SHUTDOWN
        bus.busy_with = command.op
        try:
            command.future.set_result(run_command(host, message))
        except CommandError as err:
            log.warning("command %s failed: %s", command.op, err)
            command.future.set_exception(err)
        finally:
            bus.busy_with = None
        host.after_reply()


def worker_loop(host: Host) -> None:
    """The main loop of ranks other than 0: run what rank 0 broadcasts, until shutdown."""
    while True:
        message = host.broadcast(None)
        if message["op"] == SHUTDOWN:
            return
        if message["op"] == NOOP:
            continue
        if message["op"] == POLL:
            host.poll()
            continue
        with contextlib.suppress(CommandError):
            run_command(host, message)
