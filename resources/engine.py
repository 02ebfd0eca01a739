"""The Megatron trainer as a Dagster resource: a thin client of the persistent engine service.

Each Dagster run attaches to the run root's engine service, starting it if none answers
(the embedded default), and sends it commands. If the service dies during a command (a
crash, kill -9), the resource starts it again, which resumes from the newest complete
checkpoint, and repeats the command once: the engine replays the pinned batches between the
checkpoint and the asked step and reports them as `replayed`. An engine error fails the
Dagster step with the engine's message and traceback text.
"""

import time
from collections.abc import Callable
from typing import Any, TypeVar

import dagster as dg
from pydantic import PrivateAttr

from resources.run_config import RunConfigResource
from trinity_dagster.service.client import EngineClient, EngineUnreachable
from trinity_dagster.service.launcher import connect

T = TypeVar("T")
POLL_S = 0.5


class EngineResource(dg.ConfigurableResource):
    """Sends train, save and sync commands to the run's engine service.

    One client (one connection pool) serves all commands of a run.
    """

    run_config: dg.ResourceDependency[RunConfigResource]
    autostart: bool = True
    _client: EngineClient | None = PrivateAttr(default=None)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Close the run's client."""
        self._disconnect()

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _connected(self, *, autostart: bool) -> EngineClient:
        if self._client is None:
            self._client = connect(self.run_config.config, autostart=autostart)
        return self._client

    def _with_client(self, call: Callable[[EngineClient], T]) -> T:
        try:
            return call(self._connected(autostart=self.autostart))
        except EngineUnreachable:
            if not self.autostart:
                raise
        # the service died mid-command: start it again (it resumes from the newest complete
        # checkpoint) and repeat the command once
        self._disconnect()
        return call(self._connected(autostart=True))

    def status(self) -> dict[str, Any]:
        """Step, weights version, ranks and health of the engine."""
        return self._with_client(lambda c: c.status())

    def train_step(self, step: int) -> dict[str, Any]:
        """Train step N; returns its record (metrics, replayed steps, saves and syncs)."""
        return self._with_client(lambda c: c.train_step(step))

    def save_checkpoint(self, step: int, *, hf: bool = False) -> dict[str, Any]:
        """Wait until a complete checkpoint of step N exists; returns its path and checksum.

        A background save in progress is polled, so the engine keeps training meanwhile.
        """
        return self._until_done(lambda c: c.save_checkpoint(step, block=False, hf=hf))

    def sync_weight(self, step: int) -> dict[str, Any]:
        """Wait until weights version N are published; returns their version and path."""
        return self._until_done(lambda c: c.sync_weight(step))

    def _until_done(self, call: Callable[[EngineClient], dict[str, Any]]) -> dict[str, Any]:
        deadline = time.monotonic() + self.run_config.config.service.request_timeout_s
        while True:
            result = self._with_client(call)
            if not result.get("pending"):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"still pending after the request timeout: {result}")
            time.sleep(POLL_S)
