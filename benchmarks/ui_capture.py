"""The GraphQL requests a page of the Dagster UI sends, captured from headless Chromium, and
replayed over HTTP to time each one.

Chromium loads the page with its DevTools protocol on a loopback port; every POST to
`/graphql` the page makes until it goes quiet is recorded with its body, so the queries timed
are exactly the UI's own (operation, query text and variables), whatever Dagster version is
installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from websockets.sync.client import connect

CHROMIUM = "chromium"


@dataclass(frozen=True)
class UiRequest:
    """One GraphQL request of a page: its operation name and the exact body sent."""

    operation: str
    body: bytes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _page_socket(port: int, deadline: float) -> str:
    """The DevTools websocket URL of Chromium's first page, once Chromium answers."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Chromium's DevTools did not answer on port {port}")
        time.sleep(0.2)


def capture(url: str, *, quiet_s: float = 4.0, timeout_s: float = 120.0) -> list[UiRequest]:
    """The GraphQL requests Chromium sends while loading `url`, until none came for `quiet_s`
    after the last response (or `timeout_s` passed)."""
    binary = shutil.which(CHROMIUM) or "/usr/bin/chromium"
    port = _free_port()
    with tempfile.TemporaryDirectory(
        prefix="chromium-profile-", ignore_cleanup_errors=True
    ) as profile:
        browser = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                f"--remote-debugging-port={port}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-allow-origins=*",
                f"--user-data-dir={Path(profile)}",
                "--window-size=1600,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            return _record(_page_socket(port, deadline), url, quiet_s, deadline)
        finally:
            os.killpg(browser.pid, signal.SIGKILL)  # with its renderer and GPU processes
            browser.wait()


def _record(socket_url: str, url: str, quiet_s: float, deadline: float) -> list[UiRequest]:
    """Navigate the page at `socket_url` to `url` and record its GraphQL POSTs.

    The page is quiet once no request with a body not seen before was sent for `quiet_s` and
    every such request was answered: the UI polls some queries every few seconds, and a
    repeat of a body already recorded neither counts nor waits.
    """
    seen: dict[bytes, UiRequest] = {}
    pending: set[str] = set()  # requests with a new (or not yet known) body, unanswered
    asked: dict[int, str] = {}  # DevTools call id -> request id whose body it fetches
    with connect(socket_url, max_size=None) as ws:
        calls = iter(range(1, 1_000_000))

        def call(method: str, params: dict | None = None) -> int:
            number = next(calls)
            ws.send(json.dumps({"id": number, "method": method, "params": params or {}}))
            return number

        def body(rid: str, data: str) -> None:
            nonlocal last
            if data.encode() in seen:
                pending.discard(rid)  # a poll
            else:
                seen[data.encode()] = _request(data.encode())
                last = time.monotonic()

        call("Network.enable")
        call("Page.navigate", {"url": url})
        last = time.monotonic()
        while time.monotonic() < deadline:
            if not pending and seen and time.monotonic() - last > quiet_s:
                break
            try:
                message = json.loads(ws.recv(timeout=0.5))
            except TimeoutError:
                continue
            method, params = message.get("method"), message.get("params", {})
            if method == "Network.requestWillBeSent":
                request = params["request"]
                path = urlsplit(request["url"]).path
                if request.get("method") == "POST" and path.endswith("/graphql"):
                    rid = params["requestId"]
                    pending.add(rid)
                    if "postData" in request:
                        body(rid, request["postData"])
                    else:
                        asked[call("Network.getRequestPostData", {"requestId": rid})] = rid
            elif method in ("Network.loadingFinished", "Network.loadingFailed"):
                if params["requestId"] in pending:
                    pending.discard(params["requestId"])
                    last = time.monotonic()
            elif message.get("id") in asked:
                rid = asked.pop(message["id"])
                data = message.get("result", {}).get("postData")
                if data is not None:
                    body(rid, data)
    return list(seen.values())


def _request(body: bytes) -> UiRequest:
    return UiRequest(json.loads(body).get("operationName") or "?", body)


def replay(graphql_url: str, request: UiRequest, repeats: int = 3) -> float:
    """Median seconds the webserver takes to answer `request` (sent as the UI sent it).

    Raises RuntimeError if the answer holds GraphQL errors.
    """
    times = []
    for _ in range(repeats):
        post = urllib.request.Request(
            graphql_url, data=request.body, headers={"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        with urllib.request.urlopen(post, timeout=600) as response:
            answer = json.load(response)
        times.append(time.perf_counter() - started)
        if answer.get("errors"):
            raise RuntimeError(f"{request.operation}: {answer['errors'][:2]}")
    return statistics.median(times)
