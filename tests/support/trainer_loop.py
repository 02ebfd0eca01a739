"""A `Trainer` without an engine or Dagster: a fake engine that records what the loop asks of
it, a hook that records what the loop reports, the loop's small config, and a loop run in a
thread. For the trainer loop and live-control tests."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from trinity_dagster.buffer.sampler import PinResult
from trinity_dagster.config import TrinityConfig
from trinity_dagster.testing import tiny_config
from trinity_dagster.trainer import TrainEngineWrapper, Trainer, TrainerHook

Event = tuple[Any, ...]


class PublishFailed(RuntimeError):
    """Injected: the engine failed while publishing weights (after the weights update)."""


class FakeEngine(TrainEngineWrapper):
    """Records the loop's calls; answers like the engine service does."""

    def __init__(
        self,
        *,
        step: int = 0,
        last_sync_step: int = 0,
        health_problems: dict[int, list[str]] | None = None,
        fail_publish_at: int | None = None,
    ) -> None:
        self.step = step
        self.synced = last_sync_step
        self.health_problems = health_problems or {}
        self.fail_publish_at = fail_publish_at
        self.events: list[Event] = []
        self.publish_asked: list[int] = []  # steps whose train call also publishes
        self.batches: dict[int, list[str]] = {}
        self.prepared = 0
        self.closed = 0
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self.prepared += 1

    @property
    def train_step_num(self) -> int:
        return self.step

    @property
    def last_sync_step(self) -> int:
        return self.synced

    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        assert batch.step == self.step + 1, f"step {batch.step} trained after {self.step}"
        assert batch.eids and len(set(batch.eids)) == len(batch.eids)
        self.step = batch.step
        self.batches[batch.step] = list(batch.eids)
        self._record(("train", batch.step))
        record: dict[str, Any] = {
            "step": batch.step,
            "metrics": {"actor/pg_loss": 0.1 * batch.step, "actor/grad_norm": 1.0},
            "batch_size": len(batch.eids),
            "parent_step": batch.step - 1,
            "health_problems": list(self.health_problems.get(batch.step, [])),
            "already_trained": False,
            "replayed": [],
        }
        if publish:  # as the service: withheld weights are not published
            self.publish_asked.append(batch.step)
            withheld = record["health_problems"]
            record["published"] = None if withheld else {**self.save_state_dict(), "publish_s": 0}
        return record

    def save_checkpoint(
        self,
        block_until_saved: bool = False,
        save_as_hf: bool = False,
        serves_as_sync: bool = False,
    ) -> dict[str, Any]:
        self._record(("save", self.step, block_until_saved, save_as_hf, serves_as_sync))
        if serves_as_sync:
            self.synced = self.step
        return {"step": self.step, "pending": not block_until_saved}

    def save_state_dict(self) -> dict[str, Any]:
        if self.step == self.fail_publish_at:
            self.fail_publish_at = None  # only the first attempt fails
            self._record(("publish failed", self.step))
            raise PublishFailed(f"publishing weights of step {self.step} failed")
        self._record(("publish", self.step))
        self.synced = self.step
        return {"version": self.step}

    def sync_weight_nccl(self) -> dict[str, Any]:
        raise AssertionError("sync_method nccl is not configured")

    def upload_state_dict(self) -> dict[str, Any]:
        raise AssertionError("sync_method memory is not configured")

    def close(self) -> None:
        self.closed += 1

    def _record(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e[0] == kind]


class RecordingHook(TrainerHook):
    """Records what the loop reports: the steps pinned, trained and synced, with metrics."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.steps: list[int] = []
        self.syncs: list[int] = []
        self.records: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.step_done = threading.Condition()

    def on_batch(self, step: int, batch: PinResult) -> None:
        assert batch.step == step
        self.batches.append(step)

    def on_step(self, step: int, record: dict[str, Any], metrics: dict[str, Any]) -> None:
        with self.step_done:
            self.steps.append(step)
            self.records.append(record)
            self.metrics.append(metrics)
            self.step_done.notify_all()

    def on_sync(self, step: int, info: dict[str, Any]) -> None:
        self.syncs.append(step)

    def wait_for_step(self, step: int, timeout: float = 20.0) -> None:
        with self.step_done:
            assert self.step_done.wait_for(lambda: step in self.steps, timeout), (
                f"step {step} not trained within {timeout} s: {self.steps}"
            )


def loop_config(
    tmp_path: Path,
    *,
    total_steps: int | None,
    save_interval: int = 0,
    sync_interval: int = 1,
    save_hf_checkpoint: str = "last",
    sync_style: str = "fixed",
    read_timeout_s: float = 30.0,
    sft_warmup_steps: int = 0,
) -> TrinityConfig:
    config, _ = tiny_config(
        tmp_path,
        {
            "trainer": {
                "total_steps": total_steps,
                "save_interval": save_interval,
                "save_hf_checkpoint": save_hf_checkpoint,
                "sft_warmup_steps": sft_warmup_steps,
            },
            "synchronizer": {
                "sync_method": "checkpoint",
                "sync_style": sync_style,
                "sync_interval": sync_interval,
            },
            "buffer": {"read_timeout_s": read_timeout_s},
        },
    )
    return config


def start_in_thread(trainer: Trainer) -> tuple[threading.Thread, dict[str, Any]]:
    """`trainer.run()` in a daemon thread; the outcome dict gets its `reason` or `error`."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["reason"] = asyncio.run(trainer.run())
        except BaseException as err:  # handed to the test thread
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome
