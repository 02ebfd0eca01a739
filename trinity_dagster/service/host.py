"""One rank's engine host: the train engine plus checkpoints, weight sync and step records.

Every rank runs the same commands in the same order (the command loop broadcasts them), so
the collectives inside the engine line up. Rank 0 alone writes records and markers.

Order rules for `train_step(N)` with the engine at step S:
- N <= S: the step was trained; its recorded result is returned, nothing trains;
- N == S + 1: train it;
- N > S + 1: allowed only if steps S+1..N-1 were trained before (their records exist, as
  after a crash and a restart from an older checkpoint): they are replayed from their pinned
  batches first and reported in `replayed`; otherwise refused, naming the steps.
`save_checkpoint(N)`, `publish_weights(N)`, `upload_weights(N)` and `stage_weights(N)` with
nothing of step N on disk (or held) and the engine behind N replay the recorded steps up to N
the same way first, so a command repeated after a crash gives the result it would have given
without it.
Training a step does not save or sync: the trainer loop (`trinity_dagster.trainer.Trainer`)
decides that and sends `save_checkpoint` and `publish_weights` for the step the engine is at.
A step's record lists the health problems (`step_checks`) that keep its weights from
explorers; `publish_weights` refuses such a step, and so does a save that would serve as the sync.
A record is renamed into place before the reply and flushed to disk on a thread of its own
while the next command runs; a checkpoint is saved only once every record before it is on disk.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trinity_dagster import faults
from trinity_dagster.buffer.reader import StepBatches, StepNotPinnedError, to_tensors
from trinity_dagster.buffer.sampler import sampler_state
from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.checkpoint.initial_weights import create_initial_model_apart
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    advance_checkpoint_marker,
    checkpoint_dir,
    latest_weights_version,
    published_weights_dir,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.checkpoint.manifest import (
    CorruptCheckpointError,
    read_manifest,
    verify_checkpoint,
)
from trinity_dagster.checkpoint.publish import (
    advance_weights_marker,
    prune_published,
    publish_weights,
    record_sync_from_checkpoint,
)
from trinity_dagster.checkpoint.shm_weights import (
    newest_weights_version,
    region_path,
    remove_shm_dir,
    shm_versions,
    write_shm_weights,
)
from trinity_dagster.config import SyncMethod, TrinityConfig
from trinity_dagster.engine.batch_check import BatchError
from trinity_dagster.engine.engine import TrainEngine
from trinity_dagster.files import BackgroundFsync
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.progress import install_progress_hooks
from trinity_dagster.service_api.protocol import BadRequestError, StepConflictError
from trinity_dagster.service_api.records import (
    read_record,
    record_path,
    unrecorded_span,
    write_record,
)
from trinity_dagster.service_api.state import advertised_host
from trinity_dagster.step_checks import sync_blockers
from trinity_dagster.weight_sync import announce
from trinity_dagster.weight_sync.sender import WeightSender

log = logging.getLogger(__name__)


class EngineHost:
    """Holds the engine of this rank and executes control commands on it."""

    def __init__(self, config: TrinityConfig, paths: RunPaths) -> None:
        self.config = config
        self.paths = paths
        self.started_at = time.time()
        self.progress_at = time.monotonic()
        self._training_step: int | None = None
        self._batches = StepBatches(paths)
        initial = self._initial_weights()
        self.engine = TrainEngine(config, initial)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        faults.arm(paths, self.rank)
        install_progress_hooks(self.engine, self._progress)
        self.checkpoints = CheckpointManager(config, paths, self.engine)
        self.resumed_from = self.checkpoints.resume()
        if self.rank == 0 and self.resumed_from is not None:
            self._finish_install(self.resumed_from)
        self.save_error: str | None = None
        version = newest_weights_version(paths, memory=self._memory_sync())
        self.last_sync_step = 0 if version is None else version
        self.weight_sender: WeightSender | None = None
        if self.rank == 0 and config.synchronizer.sync_method is SyncMethod.NCCL:
            host = config.service.host
            self.weight_sender = WeightSender(
                host, advertised_host(host), config.synchronizer.sync_timeout
            )
        self._status: dict[str, Any] = {}
        self._refresh_status()
        self._prune_due = False  # a publish left superseded weights for after its reply
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="weights-prune")
        self._prune: Future[None] | None = None
        self._record_flush = BackgroundFsync("record-fsync")

    def _initial_weights(self) -> Path:
        """Version 0 of the weights (created once, by a child process: see
        `create_initial_model_apart`)."""
        return create_initial_model_apart(self.config, self.paths)

    # --- command loop interface -------------------------------------------------------
    def broadcast(self, command: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's command, delivered to every rank."""
        box = [command]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        received = box[0]
        assert received is not None, "rank 0 must broadcast a command"
        return received

    def has_pending_saves(self) -> bool:
        """Whether background saves wait to be finalized."""
        return bool(self.checkpoints.pending_steps())

    def poll(self) -> None:
        """Finish background saves that are done (manifest, marker, retention).

        A failed save is logged and reported in `status` and by the next save or sync of
        that step; training goes on from the engine's state, which the failure did not touch.
        """
        try:
            self.checkpoints.poll()
        except Exception as err:
            log.exception("background checkpoint save failed")
            self.save_error = f"{type(err).__name__}: {err}"
        self._refresh_status()

    def after_reply(self) -> None:
        """Housekeeping the last command left for after its reply (rank 0): pruning the
        weights a publish superseded, on a thread of its own while the next commands run (a
        prune still running leaves this one for the next reply)."""
        if not self._prune_due or (self._prune is not None and not self._prune.done()):
            return
        self._prune_due = False
        self._prune = self._pruner.submit(self._prune_published)

    def _prune_published(self) -> None:
        """Prune superseded weights; a failure is logged and the next prune tries again."""
        try:
            prune_published(self.paths, keep=self.config.synchronizer.keep_synced_weights)
        except Exception:
            log.exception("pruning superseded weights failed")

    def status(self) -> dict[str, Any]:
        """A snapshot of the engine's state, safe to read from any thread.

        While a step trains, `training_step` names it and `since_progress_s` is the time
        since it last made progress (its start, a layer's forward or gradient, the optimizer
        step); otherwise both are None.
        """
        training = self._training_step  # read first: progress_at is set before it
        since = None if training is None else time.monotonic() - self.progress_at
        return {**self._status, "training_step": training, "since_progress_s": since}

    def close(self) -> None:
        """Wait for pending saves, then release the engine, the shared-memory weights and
        the collective sync's held versions."""
        try:
            self.checkpoints.wait_all()
        finally:
            try:
                self._pruner.shutdown()
                self._record_flush.close()
            finally:
                self.engine.close()
                if self.rank == 0 and self._memory_sync():
                    remove_shm_dir(self.paths)
                if self.weight_sender is not None:
                    announce.withdraw(self.paths)
                    self.weight_sender.close()

    def execute(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run one command; rank 0's return value is the reply."""
        handlers: dict[str, Callable[..., dict[str, Any]]] = {
            "train_step": self.train_step,
            "save_checkpoint": self.save_checkpoint,
            "publish_weights": self.publish_weights,
            "upload_weights": self.upload_weights,
            "stage_weights": self.stage_weights,
        }
        if op not in handlers:
            raise BadRequestError(f"unknown command {op!r}; known: {', '.join(handlers)}")
        try:
            return handlers[op](**args)
        finally:
            self._refresh_status()

    # --- commands ---------------------------------------------------------------------
    def train_step(
        self, step: int, pin_version: int | None = None, publish: bool = False
    ) -> dict[str, Any]:
        """Train step N (see the module docstring for the order rules); `pin_version`: the
        `batches` commit that pinned N, if the caller knows it; `publish`: then publish its
        weights (`published` in the reply, see `_publish_trained`)."""
        current = self.engine.step
        if step <= current:
            record = read_record(self.paths, step)
            if record is None:
                raise StepConflictError(
                    f"step {step} is behind the engine (at step {current}) and has no record "
                    f"at {record_path(self.paths, step)}"
                )
            result = {**record, "already_trained": True, "replayed": []}
        else:
            replayed = self._replay_up_to(step - 1, f"cannot train step {step}")
            trained = self._train(step, pin_version)
            result = {**trained, "already_trained": False, "replayed": replayed}
        if publish:
            result["published"] = self._publish_trained(step, result["health_problems"])
        return result

    def _publish_trained(self, step: int, health_problems: list[str]) -> dict[str, Any] | None:
        """`publish_weights(N)` right after training N, with the seconds it took
        (`publish_s`); None when N's health problems withhold its weights (rank 0 decides for
        every rank) or a save that serves as the sync is still being written."""
        withheld = [bool(health_problems)]
        if self.world_size > 1:
            dist.broadcast_object_list(withheld, src=0)
        if withheld[0]:
            return None
        started = time.perf_counter()
        info = self.publish_weights(step)
        if info.get("pending"):
            return None
        return {**info, "publish_s": time.perf_counter() - started}

    def save_checkpoint(
        self, step: int, block: bool = True, hf: bool = False, serves_as_sync: bool = False
    ) -> dict[str, Any]:
        """Make sure a complete checkpoint of step N exists (written now if the engine is at N).

        `serves_as_sync`: the checkpoint's HF export becomes published weights version N
        once it is complete (sync_method `checkpoint`), so the weights are written once.
        """
        ckpt = checkpoint_dir(self.paths, step)
        if serves_as_sync:
            self._refuse_withheld(step)
        if self.checkpoints.is_pending(step):
            if not block:
                return self._checkpoint_info(step, pending=True)
            self.checkpoints.wait(step)
        try:
            verify_checkpoint(ckpt, checksums=False)
            complete = True
        except CorruptCheckpointError:
            complete = False
        has_hf = hf_dir_written(ckpt / HF_SUBDIR)
        if complete and (has_hf or not (hf or serves_as_sync) or self.engine.step != step):
            if serves_as_sync and has_hf and self.last_sync_step < step:
                self._record_sync_from_checkpoint(step)
            return self._checkpoint_info(step, pending=False)
        self._replay_up_to(step, f"cannot save checkpoint of step {step}")
        if self.engine.step != step:
            raise StepConflictError(
                f"no complete checkpoint of step {step} exists and the engine is at step "
                f"{self.engine.step}; a checkpoint of step {step} can only be written right "
                "after training it"
                + (f"; last save error: {self.save_error}" if self.save_error else "")
            )
        self._save(step, hf=hf or serves_as_sync, block=block, serves_as_sync=serves_as_sync)
        if serves_as_sync:
            self.last_sync_step = step  # published when the save completes
        return self._checkpoint_info(step, pending=not block)

    def publish_weights(self, step: int) -> dict[str, Any]:
        """Make sure weights version N are published (written now if the engine is at N).

        A complete checkpoint of N with an HF export serves as the published version.
        """
        if self.checkpoints.is_pending(step):  # a save that serves as this sync is finishing
            return {"version": step, "pending": True}
        try:
            info = self._weights_info(step)
        except FileNotFoundError:
            pass
        else:
            if (latest_weights_version(self.paths) or 0) < step:
                self._refuse_withheld(step)  # a kept checkpoint of withheld weights
                self._mark_published(step)
            return info
        tensors = self._weights_of(step, "publish", "were never published")
        self._publish(step, tensors)
        return self._weights_info(step)

    def upload_weights(self, step: int) -> dict[str, Any]:
        """Make sure weights version N are in shared memory (sync_method `memory`), written
        now if the engine is at N."""
        if step in shm_versions(self.paths):
            return self._shm_info(step)
        tensors = self._weights_of(step, "upload", "are not in shared memory")
        if self.rank == 0:
            write_shm_weights(self.paths, step, tensors)
        self.last_sync_step = step
        if self.world_size > 1:
            dist.barrier()
        return self._shm_info(step)

    def stage_weights(self, step: int) -> dict[str, Any]:
        """Make sure weights version N are held for collective transfers (sync_method
        `nccl`), packed now if the engine is at N; rank 0 announces them to explorers."""
        if self.weight_sender is not None and step in self.weight_sender.versions():
            return self._staged_info(step)
        if self.config.synchronizer.sync_method is not SyncMethod.NCCL:
            raise BadRequestError("stage_weights needs synchronizer.sync_method nccl")
        tensors = self._weights_of(step, "stage", "are not held")
        if self.weight_sender is not None:
            self.weight_sender.stage(step, tensors)
            announce.announce(self.paths, step)
        self.last_sync_step = step
        if self.world_size > 1:
            dist.barrier()
        return self._staged_info(step)

    # --- internals --------------------------------------------------------------------
    def _weights_of(self, step: int, verb: str, absent: str) -> dict[str, torch.Tensor]:
        """The HF tensors of step N (full on rank 0; collective), for explorers: refused if
        the step's record withholds them, recorded steps replayed up to N first; the engine
        must then be at N (`verb` and `absent` word the refusal)."""
        self._refuse_withheld(step)
        self._replay_up_to(step, f"cannot {verb} weights of step {step}")
        if self.engine.step != step:
            raise StepConflictError(
                f"weights of step {step} {absent} and the engine is at step {self.engine.step}; "
                f"they can only be {verb}d right after training step {step}"
            )
        return self.engine.hf_state_dict()

    def _replay_up_to(self, step: int, refusal: str) -> list[int]:
        """Replay the recorded steps after the engine's step up to `step` from their pinned
        batches (the engine resumed from an older checkpoint); returns the steps replayed.

        Raises `StepConflictError` starting with `refusal` if one of them was never trained.
        """
        current = self.engine.step
        missing = unrecorded_span(self.paths, current + 1, step)
        if missing is not None:
            raise StepConflictError(
                f"{refusal}: the engine is at step {current} and steps "
                f"{missing[0]}..{missing[1]} have not been trained; train them first"
            )
        replayed = list(range(current + 1, step + 1))
        for earlier in replayed:
            log.info("replaying step %d from its pinned batch", earlier)
            self._train(earlier)
        return replayed

    def _finish_install(self, step: int) -> None:
        """Move the markers to checkpoint `step` (the newest complete one) if a crash
        between its rename and the markers left them behind."""
        advance_checkpoint_marker(self.paths, step)
        if read_manifest(checkpoint_dir(self.paths, step)).serves_as_sync:
            advance_weights_marker(self.paths, step)

    def _mark_published(self, step: int) -> None:
        """Move the weights marker to version N, whose files exist: sync-only weights whose
        publish a crash interrupted before the marker, or a checkpoint's HF export."""
        if self.rank == 0:
            if hf_dir_written(published_weights_dir(self.paths, step)):
                advance_weights_marker(self.paths, step)
            else:
                record_sync_from_checkpoint(self.paths, step)
        self.last_sync_step = step

    def _progress(self, window: str) -> None:
        """A train step made progress at `window` (where an armed fault may fire)."""
        self.progress_at = time.monotonic()
        faults.fault_point(window, self._training_step)

    def _refuse_withheld(self, step: int) -> None:
        """Raise if step N's record says its weights must not reach explorers."""
        record = read_record(self.paths, step)
        if record is not None and record["health_problems"]:
            raise BadRequestError(
                f"weights of step {step} are withheld from explorers: "
                + "; ".join(record["health_problems"])
            )

    def _record_sync_from_checkpoint(self, step: int) -> None:
        if self.rank == 0:
            record_sync_from_checkpoint(self.paths, step)
        self.last_sync_step = step

    def _train(self, step: int, pin_version: int | None = None) -> dict[str, Any]:
        started_at = time.time()
        started = time.perf_counter()
        try:
            table = self._batches.load(step, pin_version)
        except StepNotPinnedError as err:
            raise BadRequestError(
                f"{err}; materialize experience_batch for step {step} first"
            ) from err
        read_s = time.perf_counter() - started
        self.progress_at = time.monotonic()
        self._training_step = step
        try:
            metrics = self.engine.train_step(step, to_tensors(table))
        except BatchError as err:
            raise BadRequestError(f"batch of step {step} refused: {err}") from err
        finally:
            self._training_step = None
        metrics["time/load_batch"] = read_s
        problems = sync_blockers(metrics, self.config.algorithm.kl_bound)
        if problems:
            log.warning("weights of step %d must not be synced: %s", step, "; ".join(problems))
        record = {
            "step": step,
            "metrics": metrics,
            "batch_size": table.num_rows,
            "parent_step": step - 1,
            "health_problems": problems,
            "started_at": started_at,
            "trained_at": time.time(),
        }
        if self.rank == 0:
            write_record(self.paths, record, self._record_flush)
        return record

    def _save(self, step: int, *, hf: bool, block: bool, serves_as_sync: bool) -> None:
        self._record_flush.wait()  # the records up to this step reach the disk before it
        state = sampler_state(self.config, step).to_dict()
        self.checkpoints.save(
            step, sampler_state=state, hf=hf, block=block, serves_as_sync=serves_as_sync
        )

    def _publish(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.rank == 0:
            if self._prune is not None:
                self._prune.result()  # it may remove temp directories of older versions
            self._discard_abandoned_publish(step)
            publish_weights(self.paths, step, tensors, self.engine.hf_config, self.engine.hf_dir)
            self._prune_due = True
        self.last_sync_step = step
        if self.world_size > 1:
            dist.barrier()

    def _discard_abandoned_publish(self, step: int) -> None:
        """Remove the temp directories of weights version N that a crash left behind (the
        service is their only writer)."""
        for entry in scan_step_dirs(self.paths.weights):
            if entry.step == step and entry.kind == "tmp":
                log.info("removing %s, an interrupted publish of version %d", entry.path, step)
                shutil.rmtree(entry.path)

    def _checkpoint_info(self, step: int, *, pending: bool) -> dict[str, Any]:
        ckpt = checkpoint_dir(self.paths, step)
        info: dict[str, Any] = {"step": step, "path": str(ckpt), "pending": pending}
        if not pending:
            manifest = verify_checkpoint(ckpt, checksums=False)
            info.update(
                size_bytes=sum(entry.size for entry in manifest.files),
                manifest_sha256=manifest.digest(),
                files=len(manifest.files),
                has_hf=hf_dir_written(ckpt / HF_SUBDIR),
            )
        return info

    def _weights_info(self, step: int) -> dict[str, Any]:
        path = weights_dir(self.paths, step)
        return {
            "version": step,
            "pending": False,
            "path": str(path),
            "size_bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file()),
        }

    def _shm_info(self, step: int) -> dict[str, Any]:
        path = region_path(self.paths, step)
        size = path.stat().st_size if self.rank == 0 else 0
        return {"version": step, "pending": False, "path": str(path), "size_bytes": size}

    def _staged_info(self, step: int) -> dict[str, Any]:
        info: dict[str, Any] = {"version": step, "pending": False, "method": "nccl"}
        if self.weight_sender is not None:
            info.update(
                size_bytes=self.weight_sender.layout_bytes(step),
                backend=self.weight_sender.backend,
                address=self.weight_sender.address,
                port=self.weight_sender.port,
            )
        return info

    def _memory_sync(self) -> bool:
        return self.config.synchronizer.sync_method is SyncMethod.MEMORY

    def _refresh_status(self) -> None:
        self._status = {
            "health": "ok",
            "step": self.engine.step,
            "weights_version": self.last_sync_step,
            "world_size": self.world_size,
            "ranks": self.world_size,
            "resumed_from": self.resumed_from,
            "pending_saves": self.checkpoints.pending_steps(),
            "save_error": self.save_error,
            "run_root": str(self.paths.root),
            "config_hash": self.config.resolved_hash(),
            "started_at": self.started_at,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "weight_sync": None if self.weight_sender is None else self.weight_sender.status(),
        }
