"""`TrainEngineWrapper` (the engine seam of Trinity-RFT's trainer) and the engine service's one.

The trainer loop talks to an engine only through this interface. `get_trainer_wrapper`
returns `ServiceEngineWrapper`, a thin client of the persistent Megatron-core engine service
(`trinity_dagster.service`): the model lives in the service, batches are read there from
Delta by step, and each call is one HTTP request. Another engine plugs in by implementing
the ABC. No torch here.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import (
    SILENT_AFTER_S,
    SilentService,
    connect,
    find_service,
    replace_silent,
    stop_service,
)
from trinity_dagster.service.owner import dagster_deployment
from trinity_dagster.service_api.client import EngineClient, EngineError, EngineUnreachable
from trinity_dagster.service_api.state import ServiceState, read_state, read_token

if TYPE_CHECKING:
    from trinity_dagster.buffer.sampler import PinResult

T = TypeVar("T")
PENDING_POLL_S = 0.2
log = logging.getLogger(__name__)


class TrainEngineWrapper(ABC):
    """What the trainer loop needs of a training engine (Trinity-RFT's `TrainEngineWrapper`)."""

    @abstractmethod
    def prepare(self) -> None:
        """Connect to (or start) the engine; afterwards `train_step_num` is its step."""

    @property
    @abstractmethod
    def train_step_num(self) -> int:
        """The last step the engine trained (0 before the first)."""

    @property
    @abstractmethod
    def last_sync_step(self) -> int:
        """The newest weights version the engine published to explorers."""

    @abstractmethod
    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        """Train the step `batch` is pinned to; returns the step's record (`metrics` inside).

        `publish`: then publish its weights as `save_state_dict` would, in the same call; the
        record's `published` is their info (with `publish_s`), or None if they were not.
        """

    @abstractmethod
    def save_checkpoint(
        self,
        block_until_saved: bool = False,
        save_as_hf: bool = False,
        serves_as_sync: bool = False,
    ) -> dict[str, Any]:
        """Save a full checkpoint of the current step (in the background unless blocking)."""

    @abstractmethod
    def sync_weight_nccl(self) -> dict[str, Any]:
        """Hold the current weights for explorers to receive over a collective group
        (sync_method `nccl`)."""

    @abstractmethod
    def upload_state_dict(self) -> dict[str, Any]:
        """Hand the current weights to explorers in memory (sync_method `memory`)."""

    @abstractmethod
    def save_state_dict(self) -> dict[str, Any]:
        """Publish the current weights as files explorers load (sync_method `checkpoint`)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections (the engine itself keeps running)."""

    def started_engine(self) -> bool:
        """Whether `prepare` started the engine (rather than finding one running)."""
        return False

    def stop_engine(self) -> None:  # noqa: B027 - optional: only engines prepare starts
        """Stop the engine (after `close`); engines that `prepare` does not start need not."""


class ServiceEngineWrapper(TrainEngineWrapper):
    """The Megatron-core engine service of the run, through its control API.

    If the service dies during a call (a crash, kill -9), it is started again (it resumes
    from the newest complete checkpoint and replays recorded steps) and the call is repeated
    once. A `train_step` is watched while it runs: a service whose step makes no progress for
    `service.progress_timeout_s`, or whose rank 0 does not answer `status` within `SILENT_AFTER_S`,
    is killed, and the step goes the same way. Engine errors raise `EngineError` with the
    engine's message and traceback.
    """

    def __init__(self, config: TrinityConfig, *, autostart: bool = True) -> None:
        self.config = config
        self.autostart = autostart
        self._client: EngineClient | None = None
        self._call_pool: ThreadPoolExecutor | None = None  # the thread of watched calls
        self._step = 0
        self._last_sync_step = 0
        self._started = False
        self.progress_timeout_s = config.service.progress_timeout_s

    def prepare(self) -> None:
        if self._client is None and self.autostart:
            self._started = not isinstance(
                find_service(RunPaths.of_config(self.config)), ServiceState
            )
        self.refresh()

    def started_engine(self) -> bool:
        return self._started

    def stop_engine(self) -> None:
        stop_service(RunPaths.of_config(self.config))

    def refresh(self) -> dict[str, Any]:
        """Read the engine's status (step, weights version, pending saves)."""
        status = self._call(lambda c: c.status())
        self._step = int(status["step"])
        self._last_sync_step = int(status["weights_version"])
        return status

    @property
    def train_step_num(self) -> int:
        return self._step

    @property
    def last_sync_step(self) -> int:
        return self._last_sync_step

    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        record = self._call(
            lambda c: c.train_step(batch.step, batch.batch_version, publish=publish),
            watched=True,
        )
        self._step = max(self._step, batch.step)
        if record.get("published") is not None:
            self._last_sync_step = max(self._last_sync_step, batch.step)
        return record

    def save_checkpoint(
        self,
        block_until_saved: bool = False,
        save_as_hf: bool = False,
        serves_as_sync: bool = False,
    ) -> dict[str, Any]:
        step = self._step
        info = self._call(
            lambda c: c.save_checkpoint(
                step, block=block_until_saved, hf=save_as_hf, serves_as_sync=serves_as_sync
            )
        )
        if serves_as_sync:
            self._last_sync_step = step
        return info

    def save_state_dict(self) -> dict[str, Any]:
        step = self._step
        info = self._call(lambda c: c.publish_weights(step))
        self._last_sync_step = step
        return info

    def sync_weight_nccl(self) -> dict[str, Any]:
        step = self._step
        info = self._call(lambda c: c.stage_weights(step))
        self._last_sync_step = step
        return info

    def get_weight_sync_info(self) -> dict[str, Any]:
        """Where explorers join the collective weight sync (Trinity's name): the service's
        rendezvous address and port from its state file, its backend and held versions."""
        status = self.refresh().get("weight_sync")
        if status is None:
            raise ValueError(
                "the engine service does not send weights over a collective "
                f"(synchronizer.sync_method is {self.config.synchronizer.sync_method!r})"
            )
        state = read_state(RunPaths.of_config(self.config))
        port = None if state is None else state.weight_sync_port
        return {**status, "port": port if port is not None else status["port"]}

    def upload_state_dict(self) -> dict[str, Any]:
        step = self._step
        info = self._call(lambda c: c.upload_weights(step))
        self._last_sync_step = step
        return info

    def wait_for_checkpoint(self, step: int, *, hf: bool) -> dict[str, Any]:
        """Make sure a complete checkpoint of `step` exists, polling one saved in the background."""
        return self._until_done(lambda c: c.save_checkpoint(step, block=False, hf=hf))

    def publish(self, step: int) -> dict[str, Any]:
        """Make sure weights version `step` are published (waiting for a save serving as it)."""
        return self._until_done(lambda c: c.publish_weights(step))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._call_pool is not None:
            self._call_pool.shutdown()
            self._call_pool = None

    def _connected(self, *, autostart: bool) -> EngineClient:
        if self._client is None:
            # a service started here belongs to the Dagster deployment running this process
            self._client = connect(self.config, autostart=autostart, owner=dagster_deployment())
        return self._client

    def _call(self, call: Callable[[EngineClient], T], *, watched: bool = False) -> T:
        run = self._watched if watched else _plain
        try:
            return run(call, self._connected(autostart=self.autostart))
        except EngineUnreachable:
            if not self.autostart:
                raise
        # the service died mid-call: start it again (it resumes from the newest complete
        # checkpoint and replays recorded steps) and repeat the call once
        self.close()
        return run(call, self._connected(autostart=True))

    def _watched(self, call: Callable[[EngineClient], T], client: EngineClient) -> T:
        """`call(client)`, while checking every few seconds that the service makes progress;
        a hung service is killed, so that the call fails with `EngineUnreachable`."""
        every_s = min(5.0, self.progress_timeout_s / 4)
        if self._call_pool is None:
            self._call_pool = ThreadPoolExecutor(1, thread_name_prefix="engine-call")
        future = self._call_pool.submit(call, client)
        while True:
            try:
                return future.result(timeout=every_s)
            except FutureTimeout:
                self._kill_if_hung()

    def _kill_if_hung(self) -> None:
        """SIGKILL the run's service if it is silent or its train step makes no progress."""
        paths = RunPaths.of_config(self.config)
        found = find_service(paths)
        if isinstance(found, ServiceState):
            reason = self._stalled(found, paths)
            if reason is None:
                return
            found = SilentService(found, reason)
        if isinstance(found, SilentService):
            killed = replace_silent(paths, found)
            log.warning(
                "killed the hung engine service of %s (%s): pids %s",
                paths.root,
                found.reason,
                killed,
            )

    def _stalled(self, state: ServiceState, paths: RunPaths) -> str | None:
        """Why the service's train step counts as hung, or None while it makes progress."""
        try:
            with EngineClient(state.url, read_token(paths), timeout_s=SILENT_AFTER_S) as c:
                status = c.status()
        except (EngineUnreachable, EngineError, OSError):
            return None  # gone or going: the call in flight fails by itself
        since = status.get("since_progress_s")
        if since is None or since <= self.progress_timeout_s:
            return None
        return (
            f"its train step {status['training_step']} made no progress for {since:.0f} s "
            f"(more than service.progress_timeout_s={self.progress_timeout_s:g})"
        )

    def _until_done(self, call: Callable[[EngineClient], dict[str, Any]]) -> dict[str, Any]:
        deadline = time.monotonic() + self.config.service.request_timeout_s
        while True:
            result = self._call(call)
            if not result.get("pending"):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"still pending after service.request_timeout_s: {result}")
            time.sleep(PENDING_POLL_S)


def _plain(call: Callable[[EngineClient], T], client: EngineClient) -> T:
    return call(client)


def get_trainer_wrapper(config: TrinityConfig) -> TrainEngineWrapper:
    """The engine for `config`: the Megatron-core engine service of its run root."""
    return ServiceEngineWrapper(config)
