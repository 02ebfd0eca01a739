"""`Trainer`: Trinity-RFT's trainer loop over a `TrainEngineWrapper`, the one loop of this project.

`train()` repeats: sample the next batch (waiting for explorers, and serving their sync
requests meanwhile; pinned while the previous step trained if its rows landed by then,
`pin_ahead.py`), train it, sync the weights to explorers when due, save a checkpoint when
due (in the background; a save at a sync step serves as the sync under sync_method
`checkpoint`), report the step to the hook. It stops at `trainer.total_steps`, or early when
no more data will come (an explorer marked the end of data, or nothing new arrived for
`buffer.read_timeout_s`), and then always makes a final, blocking save, with a Hugging Face
export unless `trainer.save_hf_checkpoint` is `never`. Errors propagate: they end the loop
with the trainer state `failed` and the exception raised to the caller.

The Dagster graph runs this loop in its long-lived trainer run and passes a hook that logs
`experience_batch[N]`, `train_step[N]` and `synced_weights[N]`; Python users call
`asyncio.run(Trainer(config).run())` without Dagster. At each step boundary and while it
waits for data, the loop serves the control requests of Dagster runs
(`trinity_dagster.handoff.control`): save or sync now (or when it reaches the asked step),
pause (end after the current step and its due saves, the engine left at that step) and stop
(end now with the final save, as a normal end of training). After the hook, each step's metrics
also go to the tracking backends of `monitor.backends` (`trinity_dagster.monitor`), from a
thread beside the loop, and the final save's HF export to those that keep models (MLflow).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trinity_dagster.buffer.sampler import BatchPinner, PinResult
from trinity_dagster.buffer.tables import has_commit_after
from trinity_dagster.checkpoint import rules
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    latest_weights_version,
    scan_step_dirs,
)
from trinity_dagster.checkpoint.publish import published_info
from trinity_dagster.config import SyncMethod, SyncStyle, TrinityConfig
from trinity_dagster.handoff import control
from trinity_dagster.handoff.control import ControlRequest
from trinity_dagster.handoff.end_of_data import end_of_data
from trinity_dagster.handoff.sync_requests import SyncRequest, answer_requests, pending_requests
from trinity_dagster.handoff.trainer_state import DATA_ENDED, STOPPED, write_trainer_state
from trinity_dagster.handoff.wakeup import EXPLORER, TRAINER, Wakeup, wake
from trinity_dagster.lineage.checkpoint_summary import write_summary
from trinity_dagster.monitor import MonitorGroup, open_monitor
from trinity_dagster.monitor.event_thread import EventThread
from trinity_dagster.paths import RunPaths
from trinity_dagster.trainer.engine_wrapper import TrainEngineWrapper, get_trainer_wrapper
from trinity_dagster.trainer.pin_ahead import PinAhead
from trinity_dagster.trainer.preview import TABLE as PREVIEW_TABLE
from trinity_dagster.trainer.preview import RolloutPreview
from trinity_dagster.trainer.sample_metrics import sample_metrics
from trinity_dagster.weight_sync.announce import announced_version

log = logging.getLogger(__name__)


class SyncWithheldError(RuntimeError):
    """Weights due for explorers failed the step's health checks; training stops."""

    def __init__(self, step: int, problems: list[str]) -> None:
        super().__init__(
            f"weights of step {step} are withheld from explorers: {'; '.join(problems)}; "
            "training stops here (the explorers would otherwise wait for them forever)"
        )
        self.step = step
        self.problems = problems


class _Halted(Exception):
    """A pause or stop request was claimed while the loop waited for data."""


class TrainerHook:
    """Receives what the loop did; the Dagster graph logs materialisations from it."""

    def on_batch(self, step: int, batch: PinResult) -> None:
        """Step N's batch was pinned (reported after the step, before `on_step`)."""

    def on_step(self, step: int, record: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Step N trained (`record` from the engine), synced and saved as due (`metrics`)."""

    def on_sync(self, step: int, info: dict[str, Any]) -> None:
        """Weights version N are published to explorers (not called for a sync that a control
        request asked for: the asking run records it)."""

    def on_preview(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The rollout examples table was logged at step N (`trainer.enable_preview`; called
        before that step's `on_step`)."""

    def flush(self) -> None:
        """Record what was reported so far, if the hook records it later (called before the
        loop writes how training ended, which others wait for)."""


@contextmanager
def timer(metrics: dict[str, Any], name: str) -> Iterator[None]:
    """Add the seconds the block took to `metrics[name]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        metrics[name] = metrics.get(name, 0.0) + time.perf_counter() - started


class Trainer:
    """Consumes experiences and trains (Trinity-RFT's `Trainer`)."""

    def __init__(
        self,
        config: TrinityConfig,
        engine: TrainEngineWrapper | None = None,
        hook: TrainerHook | None = None,
    ) -> None:
        self.config = config
        self.paths = RunPaths.of_config(config)
        self.engine = engine if engine is not None else get_trainer_wrapper(config)
        self.hook = hook or TrainerHook()
        self._pinner = BatchPinner(config)
        self._pin_ahead = PinAhead(self._pinner, self.paths.experiences, self.paths.wakeup)
        self.total_steps = config.trainer.total_steps
        self.save_interval = config.trainer.save_interval
        self.save_hf_checkpoint = config.trainer.save_hf_checkpoint
        self.last_sync_step = 0
        self._last_record: dict[str, Any] | None = None
        self._halt: ControlRequest | None = None  # the pause or stop request being obeyed
        self._last_sync_at: float | None = None  # perf_counter() of this loop's last sync
        self._wait_metrics: dict[str, Any] = {}  # of syncs made while waiting for data
        self._wakeup: Wakeup | None = None  # bound while the loop waits for data
        self.preview = RolloutPreview(self.paths) if config.trainer.enable_preview else None
        self.monitor = MonitorGroup({})  # the tracking backends, started by prepare()
        self._metrics_log = EventThread("metrics", "logging metrics to the tracking backends")

    @property
    def train_step_num(self) -> int:
        """The last step the engine trained."""
        return self.engine.train_step_num

    async def prepare(self) -> None:
        """Start the tracking backends, connect to the engine, take its step and sync state."""
        self.monitor = open_monitor(self.config)  # before the engine: a bad setting fails fast
        self.engine.prepare()
        self.last_sync_step = self.engine.last_sync_step
        write_trainer_state(self.paths, "running", self.train_step_num)

    async def run(self, last_step: int | None = None) -> str:
        """`prepare()`, `train(last_step)`, `shutdown()`; returns why training stopped.

        An engine service that `prepare` started is stopped at the end, also after a failure
        (one that was running before is left running).
        """
        try:
            await self.prepare()
            return await self.train(last_step)
        finally:
            try:
                await self.shutdown()
            finally:
                if self.engine.started_engine():
                    self.engine.stop_engine()

    async def train(self, last_step: int | None = None) -> str:
        """Train until `trainer.total_steps` (or `last_step`) or the end of data.

        Returns why it stopped. Reaching `total_steps` or the end of data ends with the
        final blocking save; stopping at `last_step` (a range of steps) does not. With
        `total_steps` unset only the end of data (or a stop request) ends training.
        """
        ends = [n for n in (self.total_steps, last_step) if n is not None]
        end = min(ends) if ends else None
        self._halt = None
        self._wakeup = Wakeup(self.paths.wakeup, TRAINER, "loop")
        try:
            reason, final = await self._loop(end)
            self.hook.flush()
            self._metrics_log.flush()
            if final:
                self.finish(reason)
            elif self._halt is not None or control.paused_by(self.paths) is not None:
                write_trainer_state(self.paths, "paused", self.train_step_num, reason)
            self._serve_step_requests()  # those of the step it ends at
            self._refuse_open_requests(reason)
            if self._halt is not None:
                control.answer(
                    self.paths, self._halt, ok=True, message=reason, step=self.train_step_num
                )
        except Exception as err:  # an interrupted loop (killed, cancelled) resumes: no state
            with contextlib.suppress(Exception):  # the steps before the failure stay recorded
                self.hook.flush()
            with contextlib.suppress(Exception):
                self._metrics_log.flush()
            why = f"{type(err).__name__}: {err}"
            write_trainer_state(self.paths, "failed", self.train_step_num, why)
            failed = f"training failed at step {self.train_step_num}: {why}"
            self._refuse_open_requests(failed)
            if self._halt is not None:
                control.answer(self.paths, self._halt, ok=False, message=failed)
            raise
        finally:
            self._pin_ahead.take(None)  # no commit left in flight
            self._wakeup.close()
        log.info("trainer stopped at step %d: %s", self.train_step_num, reason)
        return reason

    def finish(self, reason: str) -> None:
        """End training at the current step: the final blocking save (with the HF export unless
        `save_hf_checkpoint: never`), explorers answered, the state `finished`."""
        self.save_checkpoint(block_until_saved=True, save_as_hf=self.save_hf_checkpoint != "never")
        self._publish_final_weights()
        self._log_final_model()
        answer_requests(self.paths, self._requests())  # no newer weights will come
        write_trainer_state(self.paths, "finished", self.train_step_num, reason)

    async def _loop(self, end: int | None) -> tuple[str, bool]:
        """Train up to step `end` (None: no limit); returns (why it stopped, whether a final
        save is due)."""
        # a save or sync owed by the step an earlier (killed) run trained
        await self._finish_step(final=self.train_step_num == self.total_steps)
        while end is None or self.train_step_num < end:
            if (halt := self._serve_control()) is not None:
                return halt
            metrics: dict[str, Any] = {}
            started = time.perf_counter()
            try:
                with timer(metrics, "time/read_experience"):
                    batch = await self._sample_data()
            except StopAsyncIteration as ended:
                return f"{DATA_ENDED} after step {self.train_step_num}: {ended}", True
            except _Halted:
                return self._halt_reason()
            step = batch.step
            metrics.update(self._wait_metrics)
            self._wait_metrics = {}
            metrics.update(sample_metrics(self.paths, batch))
            if end is None or step < end:
                self._pin_ahead.start(step + 1, batch.source_version)
            metrics.update(await self.train_step(batch))
            metrics.update(await self._finish_step(final=step == self.total_steps))
            metrics["time/step"] = time.perf_counter() - started
            assert self._last_record is not None
            # reported once the weights are out, so explorers go on while the hook records
            self.hook.on_batch(step, batch)
            self._log_preview(batch)
            self.hook.on_step(step, self._last_record, metrics)
            self._metrics_log.submit(functools.partial(self.monitor.log, step, metrics))
        if end is not None and end == self.total_steps:
            return f"trained all {end} steps (trainer.total_steps)", True
        return f"trained up to step {end}, the end of the requested range", False

    def _log_preview(self, batch: PinResult) -> None:
        """Collect the batch's rollout examples; log them every `sync_interval` steps."""
        if self.preview is None:
            return
        self.preview.add(batch)
        if batch.step % self.config.synchronizer.sync_interval == 0:
            rows = self.preview.take()
            self._metrics_log.submit(
                functools.partial(self.monitor.log_table, PREVIEW_TABLE, batch.step, rows)
            )
            self.hook.on_preview(batch.step, rows)

    async def _finish_step(self, *, final: bool) -> dict[str, Any]:
        """Sync and save the current step as due; the final save is left to `train`."""
        metrics: dict[str, Any] = {}
        if self.train_step_num == 0:
            return metrics
        if self.need_save() and not final:
            hf = self.save_hf_checkpoint == "always" or (
                self._warmup_ends_now() and self.save_hf_checkpoint != "never"
            )
            metrics.update(self.save_checkpoint(save_as_hf=hf))
        if final and self._checkpoint_sync():
            return metrics  # the final save serves as the sync
        metrics.update(await self._serve_sync())
        return metrics

    async def _serve_sync(self) -> dict[str, Any]:
        """Sync if due, then answer the explorers' pending requests."""
        requests = self._requests()
        metrics: dict[str, Any] = {}
        if self._sync_due(requests):
            metrics.update(await self.sync_weight())
        answer_requests(self.paths, requests)
        return metrics

    async def _sample_data(self) -> PinResult:
        """Pin the next step's batch, waiting for explorers (raises StopAsyncIteration).

        While waiting it tries to pin again only when the experiences table has a commit
        newer than the last try read (one `stat` per poll), and serves the explorers' sync
        requests.
        """
        step = self.train_step_num + 1
        ahead = self._pin_ahead.take(step)
        if ahead is not None:
            return ahead
        result = self._pinner.pin(step)
        if isinstance(result, PinResult):
            return result
        shortfall, last_growth = result, time.monotonic()
        while True:
            if has_commit_after(self.paths.experiences, shortfall.source_version):
                last_growth = time.monotonic()
                result = self._pinner.pin(step)
                if isinstance(result, PinResult):
                    return result
                shortfall = result
            ended = end_of_data(self.paths)
            if ended is not None:
                result = self._pinner.pin(step)  # data written just before the end
                if isinstance(result, PinResult):
                    return result
                raise StopAsyncIteration(f"{ended} ({result.message})")
            waited = time.monotonic() - last_growth
            if waited > self.config.buffer.read_timeout_s:
                raise StopAsyncIteration(
                    f"no new experience for {waited:.0f} s (buffer.read_timeout_s); "
                    f"{shortfall.message}"
                )
            self._wait_metrics.update(await self._serve_sync())  # waiting explorers go on
            if self._serve_control() is not None:
                raise _Halted
            self._wait_for_rows()

    def _wait_for_rows(self) -> None:
        """Sleep until an explorer wakes the loop or the poll interval passed."""
        assert self._wakeup is not None  # bound by `train`, the only caller's caller
        self._wakeup.wait()

    async def train_step(self, batch: PinResult) -> dict[str, Any]:
        """Train the step `batch` is pinned to; returns its metrics.

        A sync that is certainly due at this step (`_publishes_with_training`) is made by the
        same engine call: the explorers are woken as soon as it returns, and
        `time/train_step_call` then leaves out the publish (`time/sync_weight`).
        """
        metrics: dict[str, Any] = {}
        publish = self._publishes_with_training(batch.step)
        with timer(metrics, "time/train_step_call"):
            self._last_record = self.engine.train_step(batch, publish=publish)
        metrics.update(self._last_record["metrics"])
        published = self._last_record.get("published")
        if published is not None:
            publish_s = published.pop("publish_s")
            metrics["time/train_step_call"] -= publish_s
            metrics["time/sync_weight"] = publish_s
            self.last_sync_step = batch.step
            self._note_sync(metrics)
            self.hook.on_sync(batch.step, published)
        return metrics

    def _publishes_with_training(self, step: int) -> bool:
        """Whether step N's train call also publishes its weights: under sync_method
        `checkpoint`, when the sync rules make N's sync due whatever explorers ask, and no
        save (which would serve as the sync) is due at N."""
        if not self._checkpoint_sync() or step == self.total_steps or self._save_due(step):
            return False
        return self._sync_rules_due(step, explorer_requested=False)

    async def need_sync(self) -> bool:
        """Whether the current step's weights go to explorers now (`synchronizer` rules)."""
        return self._sync_due(self._requests())

    def need_save(self) -> bool:
        """Whether the current step saves a checkpoint (see `_save_due`)."""
        return self._save_due(self.train_step_num)

    def _save_due(self, step: int) -> bool:
        """Whether step N saves a checkpoint: every `trainer.save_interval` steps, and the SFT
        warm-up's last step when RL steps follow it (the SFT model, exported to HF unless
        `save_hf_checkpoint: never`)."""
        every = self.save_interval > 0 and step % self.save_interval == 0
        return every or step == rules.sft_model_step(self.config)

    def _warmup_ends_now(self) -> bool:
        return self.train_step_num == rules.sft_model_step(self.config)

    async def sync_weight(self) -> dict[str, Any]:
        """Send the current weights to explorers by `synchronizer.sync_method`."""
        metrics: dict[str, Any] = {}
        with timer(metrics, "time/sync_weight"):
            info = self._sync()
        self._note_sync(metrics)
        self.hook.on_sync(self.train_step_num, info)
        return metrics

    def _sync(self) -> dict[str, Any]:
        """Publish the current weights; returns their version, path and size."""
        step = self.train_step_num
        self._refuse_withheld(step)
        method = self.config.synchronizer.sync_method
        if method == "checkpoint":
            info = self.engine.save_state_dict()
        elif method == "memory":
            info = self.engine.upload_state_dict()
        else:
            info = self.engine.sync_weight_nccl()
        self.last_sync_step = step
        return info

    def save_checkpoint(
        self, block_until_saved: bool = False, save_as_hf: bool = False
    ) -> dict[str, Any]:
        """Save a full checkpoint of the current step; only a blocking one waits for it.

        Under sync_method `checkpoint`, every save of weights not yet published serves as a
        sync, as in Trinity-RFT: its HF export becomes published weights version N, written
        once, whether or not the step's sync was due. If the step's weights are withheld from
        explorers (failed health checks), the checkpoint is still written and kept, but not
        published, and `SyncWithheldError` stops training.
        """
        metrics: dict[str, Any] = {}
        step = self.train_step_num
        if step == 0:
            return metrics
        serves = self._checkpoint_sync() and self.last_sync_step != step
        withheld = self._health_problems(step) if serves else []
        serves = serves and not withheld
        with timer(metrics, "time/save_checkpoint"):
            self._summarize_lineage(step)
            self.engine.save_checkpoint(
                block_until_saved=block_until_saved,
                save_as_hf=save_as_hf or serves,
                serves_as_sync=serves,
            )
        if withheld:
            raise SyncWithheldError(step, withheld)
        if serves:
            self.last_sync_step = self.train_step_num
            self._note_sync(metrics)
            answer_requests(self.paths, self._requests())
        return metrics

    def _summarize_lineage(self, step: int) -> None:
        """Store the lineage summary of checkpoint `step` before saving it, so that the
        checkpoint's recorder reads it instead of the Delta tables (see
        `lineage.checkpoint_summary`). The save goes ahead without it if it fails (an engine
        that keeps no step records, a ledger commit that lost to concurrent ones every
        time): the recorder then computes it, and fails there with the cause if it must."""
        try:
            write_summary(self.paths, step)
        except Exception as err:  # the checkpoint matters more than its metadata
            log.warning("no lineage summary for checkpoint %d: %s", step, err)

    def _note_sync(self, metrics: dict[str, Any]) -> None:
        """Wake the explorers waiting for weights; add `time/trainer_sync_interval`: seconds
        since this loop's previous sync."""
        wake(self.paths.wakeup, EXPLORER)
        now = time.perf_counter()
        if self._last_sync_at is not None:
            metrics["time/trainer_sync_interval"] = now - self._last_sync_at
        self._last_sync_at = now

    async def shutdown(self) -> None:
        """Release the engine connection (the engine service keeps running until idle) and
        close the tracking backends."""
        try:
            self._pin_ahead.close()
            self.engine.close()
        finally:
            try:
                self._metrics_log.close()
            finally:
                self.monitor.close()

    def _publish_final_weights(self) -> None:
        """Under sync_method `memory` or `nccl`, also publish the final weights on disk, synced
        or not: versions held in memory go with the engine service, and evaluations and later
        explorers read the files (under `checkpoint` the final save published them)."""
        in_memory = self.config.synchronizer.sync_method in (SyncMethod.MEMORY, SyncMethod.NCCL)
        if in_memory and self.train_step_num > 0:
            self.engine.save_state_dict()

    def _log_final_model(self) -> None:
        if self.train_step_num > 0 and self.save_hf_checkpoint != "never":
            hf_dir = checkpoint_dir(self.paths, self.train_step_num) / HF_SUBDIR
            self.monitor.log_final_model(hf_dir)

    def _serve_control(self) -> tuple[str, bool] | None:
        """Serve the control requests due now; returns (why the loop ends, whether a final
        save is due) when a pause or stop request was claimed."""
        requests = self._serve_step_requests()
        for request in requests:
            if request.action in ("pause", "stop") and control.claim(self.paths, request):
                self._halt = request
                return self._halt_reason()
        return None

    def _serve_step_requests(self) -> list[ControlRequest]:
        """Serve the save and sync requests due now; returns every pending request seen."""
        requests = control.pending_requests(self.paths)
        for request in requests:
            if request.action in ("save", "sync"):
                self._serve_step_request(request)
        return requests

    def _halt_reason(self) -> tuple[str, bool]:
        assert self._halt is not None
        at, by = self.train_step_num, self._halt.request_id
        if self._halt.action == "stop":
            return f"{STOPPED} {by} at step {at}", True
        return f"paused by request {by} at step {at}", False

    def _serve_step_request(self, request: ControlRequest) -> None:
        """Save or sync the current step for a run that asked; a request for a later step
        waits for it, one for a step that is gone is refused with what is still possible."""
        assert request.step is not None
        step, now, total = request.step, self.train_step_num, self.total_steps
        if (now < step and (total is None or step <= total)) or not control.claim(
            self.paths, request
        ):
            return
        try:
            if total is not None and step > total:
                raise ValueError(
                    f"training ends at step {self.total_steps} (trainer.total_steps), "
                    f"before step {step}"
                )
            result = (
                self._save_now(step, request.hf)
                if request.action == "save"
                else self._sync_now(step)
            )
        except Exception as err:  # the asking run fails with it; training goes on
            log.warning("refused %s: %s", request.describe(), err)
            control.answer(self.paths, request, ok=False, message=str(err))
            return
        control.answer(self.paths, request, ok=True, message=f"{request.action} done", **result)

    def _save_now(self, step: int, hf: bool) -> dict[str, Any]:
        if step < self.train_step_num:
            kept = [d.step for d in scan_step_dirs(self.paths.checkpoints) if d.kind == "final"]
            raise ValueError(
                f"step {step} can no longer be saved: the engine is at step "
                f"{self.train_step_num} (that step and later ones can be saved); kept "
                f"checkpoints: {', '.join(map(str, kept)) or 'none'}"
            )
        self.save_checkpoint(save_as_hf=hf)
        return {"path": str(checkpoint_dir(self.paths, step))}

    def _sync_now(self, step: int) -> dict[str, Any]:
        if step == self.train_step_num:  # published now, or by a save still being written
            return self._sync()
        info = published_info(self.paths, step)
        if info is None:
            raise ValueError(
                f"weights of step {step} were not published and the engine is at step "
                f"{self.train_step_num}; only the current step's weights can be published now "
                f"(newest published version: {latest_weights_version(self.paths) or 0})"
            )
        return info

    def _refuse_open_requests(self, reason: str) -> None:
        """Answer the save and sync requests that this loop will not reach."""
        for request in control.pending_requests(self.paths):
            if request.action in ("save", "sync") and control.claim(self.paths, request):
                control.answer(
                    self.paths,
                    request,
                    ok=False,
                    message=f"the trainer loop ended before serving it ({reason})",
                )

    def _checkpoint_sync(self) -> bool:
        return self.config.synchronizer.sync_method is SyncMethod.CHECKPOINT

    def _requests(self) -> list[SyncRequest]:
        if self.config.synchronizer.sync_style is not SyncStyle.EXPLORER_DRIVEN:
            return []
        return pending_requests(self.paths)

    def _sync_due(self, requests: list[SyncRequest]) -> bool:
        step = self.train_step_num
        if self._held_weights_lost():
            return True
        return self._sync_rules_due(
            step, explorer_requested=any(r.have_version < step for r in requests)
        )

    def _sync_rules_due(self, step: int, *, explorer_requested: bool) -> bool:
        """`rules.need_sync` of step N under this run's synchronizer and the last sync."""
        sync = self.config.synchronizer
        return rules.need_sync(
            step,
            sync_interval=sync.sync_interval,
            last_sync_step=min(self.last_sync_step, step),
            style=sync.sync_style,
            explorer_requested=explorer_requested,
        )

    def _held_weights_lost(self) -> bool:
        """Under sync_method `nccl`: the current step's synced weights lived in an engine
        service that is gone (killed, restarted), and no file holds them: explorers waiting
        for them would wait forever, so they are held again."""
        step = self.train_step_num
        if (
            self.config.synchronizer.sync_method is not SyncMethod.NCCL
            or not 0 < self.last_sync_step == step
        ):
            return False
        if announced_version(self.paths) == step:
            return False
        return (latest_weights_version(self.paths) or 0) < step

    def _refuse_withheld(self, step: int) -> None:
        problems = self._health_problems(step)
        if problems:
            raise SyncWithheldError(step, problems)

    def _health_problems(self, step: int) -> list[str]:
        """Why step N's weights must not reach explorers (empty: they may)."""
        record = self._last_record
        if record is None or record["step"] != step:
            return []
        return list(record["health_problems"])
