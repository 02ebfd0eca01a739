"""The engine service's guards: token first, bounded bodies, step ranges, frozen services.

Most tests drive the control API in-process (no engine); two start the real service, for
what only real processes show: listening sockets and a stopped rank 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest

from trinity_dagster.cli import main as cli_main
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import connect, stop_service
from trinity_dagster.service.processes import service_processes
from trinity_dagster.service.server import MAX_BODY_BYTES, build_app
from trinity_dagster.service_api.protocol import MAX_STEP, StepConflictError
from trinity_dagster.service_api.records import unrecorded_span, write_record
from trinity_dagster.service_api.state import (
    MIN_TOKEN_CHARS,
    TokenFileError,
    ensure_token,
    pid_alive,
    read_state,
    read_token,
    token_path,
)
from trinity_dagster.testing import tiny_config

TOKEN = "t" * MIN_TOKEN_CHARS
CHUNK = 64 * 1024


class RecordingBus:
    """Stands in for the command bus: records commands, answers at once."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, dict[str, Any]]] = []
        self.busy_with = None

    def submit(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.commands.append((op, args))
        return {"op": op, **args}


class CountingBody:
    """A request body streamed in 64 KiB chunks, counting how many the server pulled."""

    def __init__(self, total_bytes: int) -> None:
        self.chunks = total_bytes // CHUNK
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.pulled += 1
            yield b"x" * CHUNK


def call(method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, RecordingBus]:
    """One request to an in-process control API; the reply and the commands it queued."""
    bus = RecordingBus()
    app = build_app(bus, TOKEN, lambda: {"step": 0}, timeout=5)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send()), bus


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer "}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
)
def test_unauthenticated_bodies_are_never_read(headers: dict[str, str]) -> None:
    body = CountingBody(400 * 1024 * 1024)
    response, bus = call("POST", "/train_step", headers=headers, content=body)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert body.pulled <= 1 and bus.commands == []


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/status", "/shutdown"])
def test_every_path_needs_the_token(path: str) -> None:
    response, bus = call("GET", path)
    assert response.status_code == 401 and bus.commands == []


def test_bodies_over_the_limit_get_413_while_streaming() -> None:
    body = CountingBody(400 * 1024 * 1024)  # chunked: no Content-Length
    response, bus = call("POST", "/train_step", headers=AUTH, content=body)
    assert response.status_code == 413
    assert body.pulled <= MAX_BODY_BYTES // CHUNK + 1 and bus.commands == []

    lying = CountingBody(4 * MAX_BODY_BYTES)
    response, bus = call(
        "POST", "/train_step", headers={**AUTH, "Content-Length": "12"}, content=lying
    )
    assert response.status_code == 413 and bus.commands == []

    declared = CountingBody(4 * MAX_BODY_BYTES)
    big = {**AUTH, "Content-Length": str(10**12)}
    response, bus = call("POST", "/train_step", headers=big, content=declared)
    assert response.status_code == 413 and declared.pulled == 0 and bus.commands == []


def test_only_json_bodies_are_accepted() -> None:
    plain = {**AUTH, "Content-Type": "text/plain"}
    response, bus = call("POST", "/train_step", headers=plain, content=b'{"step": 1}')
    assert response.status_code == 422 and bus.commands == []
    response, bus = call("POST", "/train_step", headers=AUTH, json={"step": 1})
    assert response.status_code == 200
    assert bus.commands == [("train_step", {"step": 1, "pin_version": None, "publish": False})]


@pytest.mark.parametrize("publish", [1, "true", None], ids=["int", "text", "null"])
def test_publish_with_a_train_step_must_be_a_json_boolean(publish: object) -> None:
    response, bus = call("POST", "/train_step", headers=AUTH, json={"step": 1, "publish": publish})
    assert response.status_code == 422 and bus.commands == []
    assert "publish" in response.json()["error"]
    response, bus = call("POST", "/train_step", headers=AUTH, json={"step": 1, "publish": True})
    assert bus.commands == [("train_step", {"step": 1, "pin_version": None, "publish": True})]


@pytest.mark.parametrize(
    ("path", "step", "allowed"),
    [
        ("/train_step", 0, f"1..{MAX_STEP}"),
        ("/train_step", MAX_STEP + 1, f"1..{MAX_STEP}"),
        ("/save_checkpoint", 10**30, f"1..{MAX_STEP}"),
        ("/publish_weights", 10**300, f"0..{MAX_STEP}"),
        ("/publish_weights", -1, f"0..{MAX_STEP}"),
    ],
)
def test_steps_outside_the_range_are_refused_by_name(path: str, step: int, allowed: str) -> None:
    response, bus = call("POST", path, headers=AUTH, json={"step": step})
    assert response.status_code == 422 and bus.commands == []
    message = response.json()["error"]
    assert f"step {step} is outside the allowed range {allowed}" in message, message


@pytest.mark.parametrize(
    "path", ["/train_step", "/save_checkpoint", "/publish_weights", "/upload_weights"]
)
@pytest.mark.parametrize("step", [True, False, "1", 1.0], ids=["true", "false", "text", "float"])
def test_a_step_that_is_not_a_json_integer_is_refused_by_name(path: str, step: object) -> None:
    response, bus = call("POST", path, headers=AUTH, json={"step": step})
    assert response.status_code == 422 and bus.commands == []
    message = response.json()["error"]
    assert message == f"invalid request to {path}: body.step: Input should be a valid integer"


def test_the_client_sends_every_step_as_a_json_integer() -> None:
    from trinity_dagster.service_api.client import EngineClient

    sent: list[tuple[str, bytes]] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.content))
        return httpx.Response(200, json={})

    client = EngineClient("http://engine", TOKEN)
    client._client = httpx.Client(base_url="http://engine", transport=httpx.MockTransport(record))
    client.train_step(3)
    client.save_checkpoint(3, block=False, hf=True)
    client.publish_weights(3)
    client.upload_weights(3)
    assert [path for path, _ in sent] == [
        "/train_step",
        "/save_checkpoint",
        "/publish_weights",
        "/upload_weights",
    ]
    for path, body in sent:
        assert type(json.loads(body)["step"]) is int, path
        headers = {**AUTH, "Content-Type": "application/json"}
        response, bus = call("POST", path, headers=headers, content=body)
        assert response.status_code == 200 and bus.commands[0][1]["step"] == 3, path


def test_train_step_far_ahead_is_refused_without_walking_the_steps(tmp_path: Path) -> None:
    from trinity_dagster.service.host import EngineHost

    paths = RunPaths.of(tmp_path)
    for step in (1, 2, 4):
        write_record(paths, {"step": step})
    host = SimpleNamespace(engine=SimpleNamespace(step=0), paths=paths)
    host._replay_up_to = lambda step, refusal: EngineHost._replay_up_to(host, step, refusal)  # type: ignore[arg-type]
    started = time.perf_counter()
    with pytest.raises(StepConflictError, match=f"steps 3..{MAX_STEP - 1} have not been trained"):
        EngineHost.train_step(host, MAX_STEP)  # type: ignore[arg-type]
    assert time.perf_counter() - started < 1.0
    assert unrecorded_span(paths, 1, 2) is None
    assert unrecorded_span(paths, 1, 5) == (3, 5)
    assert unrecorded_span(paths, 2, 4) == (3, 3)


@pytest.mark.parametrize("token", ["", " ", "short", "x" * (MIN_TOKEN_CHARS - 1)])
def test_empty_or_short_tokens_are_refused_on_both_sides(tmp_path: Path, token: str) -> None:
    with pytest.raises(TokenFileError, match=f"at least {MIN_TOKEN_CHARS}"):
        build_app(RecordingBus(), token, dict, timeout=5)  # type: ignore[arg-type]
    paths = RunPaths.of(tmp_path)
    paths.service.mkdir(parents=True)
    token_path(paths).write_text(token)
    token_path(paths).chmod(0o600)
    with pytest.raises(TokenFileError, match=re.escape(str(token_path(paths)))):
        read_token(paths)
    with pytest.raises(TokenFileError):
        ensure_token(paths)


def test_new_token_is_long_and_private_whatever_the_umask(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    old_umask = os.umask(0)
    try:
        token = ensure_token(paths)
    finally:
        os.umask(old_umask)
    assert len(token) >= MIN_TOKEN_CHARS
    assert stat.S_IMODE(token_path(paths).stat().st_mode) == 0o600
    assert ensure_token(paths) == token
    assert [p.name for p in paths.service.iterdir()] == [token_path(paths).name]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _listening(processes: list[psutil.Process]) -> list[tuple[int, str, int]]:
    found = []
    for process in processes:
        for conn in process.net_connections("inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((process.pid, conn.laddr.ip, conn.laddr.port))
    return found


@pytest.mark.parametrize("ranks", [1, 2])
def test_service_listens_on_loopback_only_and_drops_unauthenticated_bodies(
    tmp_path: Path, ranks: int
) -> None:
    config, _ = tiny_config(tmp_path, {"megatron": {"data_parallel_size": ranks}})
    paths = RunPaths.of(config.run_root)
    try:
        with connect(config) as client:
            state = read_state(paths)
            processes = service_processes(state)
            sockets = _listening(processes)
            if ranks == 1:  # rank 0 alone, without torchrun's agent
                assert [p.pid for p in processes] == [state.pid] == [state.launcher_pid]
            else:  # the agent and its ranks; the agent hosts the rendezvous store
                assert len(processes) == 1 + ranks
                assert any(pid == state.launcher_pid for pid, _, _ in sockets)
            assert any(pid == state.pid for pid, _, _ in sockets)  # the control API
            assert all(ip == "127.0.0.1" for _, ip, _ in sockets), sockets

            rank0 = psutil.Process(state.pid)
            before = rank0.memory_info().rss
            body = (b"x" * CHUNK for _ in range(200 * 1024 * 1024 // CHUNK))
            with httpx.Client(trust_env=False) as raw:
                response = raw.post(client.url + "/train_step", content=body)
            assert response.status_code == 401
            assert rank0.memory_info().rss - before < 50 * 1024 * 1024
            assert client.status()["step"] == 0
    finally:
        stop_service(paths)


def test_frozen_service_is_reported_then_replaced(tmp_path: Path, capsys) -> None:
    config, config_file = tiny_config(tmp_path)
    paths = RunPaths.of(config.run_root)
    cli = ["engine", "-c", str(config_file)]
    try:
        connect(config).close()
        frozen = read_state(paths)
        old_processes = service_processes(frozen)
        os.kill(frozen.pid, signal.SIGSTOP)
        _wait_for(lambda: psutil.Process(frozen.pid).status() == psutil.STATUS_STOPPED)
        capsys.readouterr()

        started = time.monotonic()
        assert cli_main([cli[0], "status", *cli[1:]]) == 1
        assert time.monotonic() - started < 5
        out, err = capsys.readouterr()
        assert '"answering": false' in out
        assert f"pid {frozen.pid} (stopped)" in err and "engine start" in err

        assert cli_main([cli[0], "start", *cli[1:]]) == 0
        out, err = capsys.readouterr()
        assert f"pid {frozen.pid} (stopped)" in err and "killed" in err
        report = json.loads(out)
        assert report["running"] and report["step"] == 0
        assert report["owner"] is None  # started by hand: no deployment owns it
        assert not any(pid_alive(process.pid) for process in old_processes)
        replaced = read_state(paths)
        assert replaced.pid != frozen.pid
        with connect(config, autostart=False) as client:
            assert client.status()["step"] == 0
    finally:
        stop_service(paths)
