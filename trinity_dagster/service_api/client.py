"""A thin HTTP client of the engine service's control API (httpx; no torch)."""

from __future__ import annotations

from typing import Any

import httpx

from trinity_dagster.service_api.protocol import TOKEN_HEADER

CONNECT_TIMEOUT_S = 5.0


class EngineError(RuntimeError):
    """The engine refused or failed a command; holds the engine's message and traceback."""

    def __init__(self, status: int, message: str, kind: str = "", traceback_text: str = "") -> None:
        text = f"engine service answered {status} ({kind or 'error'}): {message}"
        if traceback_text:
            text += f"\n--- engine traceback ---\n{traceback_text.rstrip()}"
        super().__init__(text)
        self.status = status
        self.message = message
        self.kind = kind
        self.traceback_text = traceback_text


class EngineUnreachable(ConnectionError):
    """No service answers at the address."""


class EngineTimeout(TimeoutError):
    """The service took longer than the client's timeout to answer."""


class EngineClient:
    """Sends control commands to one running engine service."""

    def __init__(self, url: str, token: str, timeout_s: float = 1800.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._client = httpx.Client(
            base_url=url,
            headers={TOKEN_HEADER: f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            trust_env=False,
        )

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            response = self._client.request(method, path, json=body)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as err:
            raise EngineUnreachable(f"engine service at {self.url} is unreachable: {err}") from err
        except httpx.TimeoutException as err:
            raise EngineTimeout(
                f"engine service at {self.url} did not answer {method} {path} in time "
                f"({type(err).__name__}; timeouts: connect {CONNECT_TIMEOUT_S:g} s, "
                f"reply {self.timeout_s:g} s)"
            ) from err
        if response.status_code == 200:
            return response.json()
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": response.text}
        message = payload.get("error") or payload.get("detail") or response.reason_phrase
        raise EngineError(
            response.status_code,
            str(message),
            payload.get("type", ""),
            payload.get("traceback", ""),
        )

    def status(self) -> dict[str, Any]:
        """Step, weights version, ranks and health of the service."""
        return self._call("GET", "/status")

    def train_step(
        self, step: int, pin_version: int | None = None, *, publish: bool = False
    ) -> dict[str, Any]:
        """Train step N (or return its recorded result if already trained); `pin_version`:
        the `batches` commit that pinned N, if known; `publish`: then publish its weights."""
        body = {"step": step, "pin_version": pin_version, "publish": publish}
        return self._call("POST", "/train_step", body)

    def save_checkpoint(
        self, step: int, *, block: bool = True, hf: bool = False, serves_as_sync: bool = False
    ) -> dict[str, Any]:
        """Make sure a complete checkpoint of step N exists (optionally serving as the sync)."""
        body = {"step": step, "block": block, "hf": hf, "serves_as_sync": serves_as_sync}
        return self._call("POST", "/save_checkpoint", body)

    def publish_weights(self, step: int) -> dict[str, Any]:
        """Make sure the weights of step N are published to explorers."""
        return self._call("POST", "/publish_weights", {"step": step})

    def upload_weights(self, step: int) -> dict[str, Any]:
        """Make sure the weights of step N are in shared memory for local explorers."""
        return self._call("POST", "/upload_weights", {"step": step})

    def stage_weights(self, step: int) -> dict[str, Any]:
        """Make sure the weights of step N are held for collective transfers to explorers."""
        return self._call("POST", "/stage_weights", {"step": step})

    def weights_transfer(self, version: int, receiver: str) -> dict[str, Any]:
        """Start a collective transfer of held weights `version` to `receiver`; returns the
        group to join and the layout of what comes."""
        return self._call("POST", "/weights/transfer", {"version": version, "receiver": receiver})

    def shutdown(self) -> dict[str, Any]:
        """Ask the service to finish pending saves and exit."""
        return self._call("POST", "/shutdown")
