"""Drive a real `dagster dev` from a test: start/stop it, GraphQL calls, headless Chromium.

`dagster dev` started in the background ignores SIGINT/SIGTERM unless it leads its own
process group, so it is started in a new session and stopped by signalling the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from trinity_dagster.config import CONFIG_ENV_VAR
from trinity_dagster.testing import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
LOCATION = "trinity_dagster"
REPOSITORY = "__repository__"
REPOSITORY_SELECTOR = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
FINISHED_RUN = {"SUCCESS", "FAILURE", "CANCELED"}
FINISHED_BACKFILL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}


class GraphQLError(AssertionError):
    """The webserver answered a GraphQL call with errors or an error result type."""


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes whose environment has `name=value` (this process excluded)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@dataclass
class DagsterDev:
    """One `dagster dev -w workspace.yaml` on 127.0.0.1, in its own process group."""

    dagster_home: Path
    config_file: Path
    log_file: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the webserver."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Launch the webserver and daemon (returns before they answer)."""
        env = {
            **os.environ,
            "DAGSTER_HOME": str(self.dagster_home),
            CONFIG_ENV_VAR: str(self.config_file),
            "PYTHONUNBUFFERED": "1",
        }
        dagster = Path(sys.executable).parent / "dagster"
        command = [str(dagster), "dev", "-w", "workspace.yaml"]
        command += ["-h", "127.0.0.1", "-p", str(self.port)]
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 60) -> str:
        """The end of the `dagster dev` log."""
        if not self.log_file.exists():
            return "(no log)"
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def wait_until_up(self, timeout_s: float) -> None:
        """Block until the code location is loaded and answers GraphQL; fail with the log."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(
                    f"dagster dev exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                data = self.graphql(
                    "query { workspaceOrError { __typename ... on Workspace { locationEntries {"
                    " name loadStatus locationOrLoadError { __typename"
                    " ... on PythonError { message } } } } } }",
                    timeout_s=10,
                )
                entries = data["workspaceOrError"]["locationEntries"]
                loaded = [e for e in entries if e["name"] == LOCATION]
                if loaded and loaded[0]["loadStatus"] == "LOADED":
                    result = loaded[0]["locationOrLoadError"]
                    if result["__typename"] == "PythonError":
                        raise AssertionError(f"code location failed to load: {result['message']}")
                    return
                last = f"location entries: {entries}"
            except (httpx.HTTPError, GraphQLError) as err:
                last = f"{type(err).__name__}: {err}"
            time.sleep(1)
        raise AssertionError(
            f"dagster dev did not come up within {timeout_s:.0f} s ({last}):\n{self.log_tail()}"
        )

    def graphql(
        self, query: str, variables: dict[str, Any] | None = None, timeout_s: float = 60
    ) -> dict[str, Any]:
        """The `data` of a GraphQL call; raises `GraphQLError` on errors."""
        response = httpx.post(
            f"{self.url}/graphql",
            json={"query": query, "variables": variables or {}},
            timeout=timeout_s,
            trust_env=False,
        )
        if response.status_code != 200:
            raise GraphQLError(f"GraphQL HTTP {response.status_code}: {response.text[:2000]}")
        payload = response.json()
        if payload.get("errors"):
            raise GraphQLError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    def stop(self, timeout_s: float = 60, grace_s: float = 10) -> None:
        """Stop the whole process group: SIGTERM; once `dagster dev` itself has ended (or
        `timeout_s` passed), SIGKILL whatever of the group outlives it by `grace_s` (a code
        server that `dagster dev` restarted while shutting down waits 45 s for a heartbeat
        before it ends on its own)."""
        if self.process is None:
            return
        pgid = self.process.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self.process.wait(timeout=10)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def expect_type(result: dict[str, Any], typename: str, what: str) -> dict[str, Any]:
    """`result` if its `__typename` is `typename`; otherwise fail showing it."""
    if result.get("__typename") != typename:
        raise GraphQLError(f"{what}: expected {typename}, got {result}")
    return result


def chromium(
    url: str, *, screenshot: Path | None = None, budget_ms: int = 20000, height: int = 1000
) -> str:
    """Render `url` in headless Chromium (a window 1600 wide, `height` high); returns the DOM,
    and saves a screenshot if asked."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size=1600,{height}",
            f"--virtual-time-budget={budget_ms}",
        ]
        command += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        done = subprocess.run(
            [*command, url], capture_output=True, text=True, timeout=180, cwd=profile
        )
    if done.returncode != 0:
        raise AssertionError(
            f"chromium failed on {url} (code {done.returncode}):\n{done.stderr[-3000:]}"
        )
    if screenshot is not None and not screenshot.is_file():
        raise AssertionError(f"chromium wrote no screenshot of {url}:\n{done.stderr[-3000:]}")
    return done.stdout
