"""The trainer loop a `train` run drives (`assets.training`), and the batches it pins alone.

`run_trainer` runs `Trainer.train` with `DagsterTrainerHook`, which logs
`experience_batch[N]`, `train_step[N]` (every metric), the step's health checks and
`synced_weights[N]` as each step finishes; `pin_batches` pins the steps' batches when a run
selects `experience_batch` alone. `train` imports this module when it runs: it needs the data
libraries (pyarrow, deltalake), which the code server, loading the definitions and running
the sensors, does without.
"""

import asyncio
import functools
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from assets.lineage import (
    INPUT_DATA_VERSION_TAG,
    batch_data_version,
    data_version,
    step_upstream,
)
from assets.partitions import step_key
from assets.step_runs import (
    StepPartitions,
    numeric_metadata,
    run_last_step,
    step_materialization,
)
from assets.sync import sync_metadata
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.buffer.sampler import PinResult, PinShortfall, pin_batch
from trinity_dagster.checkpoint.layout import latest_weights_version
from trinity_dagster.graph_names import BATCH, SYNCED, TRAIN
from trinity_dagster.lineage.queries import counts_by
from trinity_dagster.monitor.base import markdown_table
from trinity_dagster.monitor.event_thread import EventThread
from trinity_dagster.service_api.records import read_record
from trinity_dagster.step_checks import kl_within_bound, loss_is_finite
from trinity_dagster.trainer import SyncWithheldError, Trainer, TrainerHook
from trinity_dagster.trainer.preview import TABLE as PREVIEW_TABLE


def batch_table(run_config: RunConfigResource, step: int, pinned: PinResult) -> pa.Table:
    """The train rows of step N's batch (as pinned, or read back from `batches`)."""
    return pinned.rows if pinned.rows is not None else load_step_batch(run_config.config, step)


def batch_metadata(table: pa.Table, pinned: PinResult, current: int) -> dict[str, Any]:
    """Size, reward statistics, source table version and staleness of a step's batch (`table`,
    its train rows) against `current`, the newest published weights version."""
    rewards = table.column("reward")
    versions = table.column("model_version")
    return {
        "batch_size": table.num_rows,
        "groups": len(pc.unique(table.column("group_id"))),
        "reward_mean": pc.mean(rewards).as_py(),
        "reward_std": pc.stddev(rewards).as_py(),
        "reward_min": pc.min(rewards).as_py(),
        "reward_max": pc.max(rewards).as_py(),
        "source_table_version": pinned.source_version,
        "model_version_min": pc.min(versions).as_py(),
        "model_version_max": pc.max(versions).as_py(),
        "model_version_drift": current - pc.min(versions).as_py(),
        "already_pinned": not pinned.newly_pinned,
    }


def train_metadata(record: dict[str, Any], metrics: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """Every numeric metric of the step, plus lineage and what was saved and synced."""
    return {
        **numeric_metadata(metrics),
        "parent_step": record["parent_step"],
        "batch_size": record["batch_size"],
        "health_problems": "; ".join(record["health_problems"]) or "none",
        "replayed_steps": ",".join(str(s) for s in record.get("replayed", [])),
        "already_trained": record.get("already_trained", False),
        **flags,
    }


class DagsterTrainerHook(TrainerHook):
    """Logs each step the loop finished: its batch, its training and checks, its sync.

    The events are built and logged on a thread beside the loop (`EventThread`), in order;
    the loop's thread only takes what may change by the next step (the published weights
    version, the preview). `flush` waits for them, and the loop flushes before it records
    how training ended.
    """

    def __init__(self, context: dg.AssetExecutionContext, run_config: RunConfigResource) -> None:
        self.context = context
        self.run_config = run_config
        self.synced: set[int] = set()
        self.recorded = context.instance.get_materialized_partitions(dg.AssetKey(TRAIN))
        self.partitions = StepPartitions(context.instance)
        # the last batch reported: its step, data version and upstream metadata for the step
        self.upstream: tuple[int, str, dict[str, Any]] | None = None
        self.preview: tuple[int, list[dict[str, Any]]] | None = None  # the last one logged
        self.events = EventThread("dagster-events")

    def log(
        self, asset: str, step: int, metadata: dict[str, Any], tags: dict[str, str] | None = None
    ) -> None:
        """Log the materialisation of step N's partition of `asset` (added if new)."""
        event = step_materialization(asset, step, metadata, tags)
        self.events.submit(functools.partial(self._log_now, step, event))

    def _log_now(self, step: int, event: dg.AssetMaterialization) -> None:
        """Log `event` of step N's partition (added if new), on the event thread."""
        self.partitions.ensure(step)
        self.context.log_event(event)

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        """Log what is still queued and end the event thread."""
        self.events.close()

    def on_batch(self, step: int, batch: PinResult) -> None:
        current = latest_weights_version(self.run_config.paths) or 0

        def log() -> None:
            table = batch_table(self.run_config, step, batch)
            digest = batch_data_version(batch.eids)
            self.upstream = (
                step,
                digest,
                step_upstream(step, counts_by(table, "model_version"), batch.batch_version),
            )
            metadata = batch_metadata(table, batch, current)
            self._log_now(step, step_materialization(BATCH, step, metadata, data_version(digest)))

        self.events.submit(log)

    def on_step(self, step: int, record: dict[str, Any], metrics: dict[str, Any]) -> None:
        if record.get("already_trained") and step_key(step) in self.recorded:
            return  # logged by the run that trained it
        flags = {
            "weights_version": latest_weights_version(self.run_config.paths) or 0,
            "synced": step in self.synced,
            "saved": "time/save_checkpoint" in metrics,
        }
        preview = self.preview[1] if self.preview is not None and self.preview[0] == step else None

        def log() -> None:  # after on_batch's, which set `upstream`
            at, digest, upstream = self.upstream or (None, None, {})
            tags = {INPUT_DATA_VERSION_TAG.format(BATCH): digest} if at == step and digest else None
            metadata = train_metadata(
                record,
                metrics,
                **self.check(step, record["metrics"]),
                **(upstream if at == step else step_upstream(step)),
                **flags,
            )
            if preview is not None:
                metadata[PREVIEW_TABLE] = dg.MetadataValue.md(markdown_table(preview))
            self._log_now(step, step_materialization(TRAIN, step, metadata, tags))

        self.events.submit(log)

    def on_preview(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.preview = (step, rows)

    def on_sync(self, step: int, info: dict[str, Any]) -> None:
        self.synced.add(step)
        self.log(SYNCED, step, sync_metadata(info))

    def check(self, step: int, metrics: dict[str, Any]) -> dict[str, str]:
        """Log step N's results of the blocking health checks (an evaluation each, naming the
        step), on the event thread; returns them as `check/<name>` metadata, which the step's
        partition page shows.

        The checks are not partitioned: the UI computes a partitioned check's status of every
        partition on each view (1.6 s at 1,000 steps, growing with the steps, `bench scale`),
        while an unpartitioned check's view reads its latest evaluations.
        """
        kl_bound = self.run_config.config.algorithm.kl_bound
        results = {
            "loss_is_finite": loss_is_finite(metrics),
            "kl_within_bound": kl_within_bound(metrics, kl_bound),
        }
        for name, (ok, reason) in results.items():
            evaluation = dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(TRAIN),
                check_name=name,
                passed=ok,
                metadata={"reason": reason, "step": step},
                blocking=True,
            )
            self.context.log_event(evaluation)
        return {
            f"check/{name}": "passed" if ok else f"failed: {reason}"
            for name, (ok, reason) in results.items()
        }

    def record_unlogged(self, steps: list[int]) -> None:
        """Log steps of the run that the engine trained but no run recorded (a killed run)."""
        for step in steps:
            record = read_record(self.run_config.paths, step)
            if record is None:
                return
            if step_key(step) not in self.recorded:
                self.events.submit(functools.partial(self._log_recovered, step, record))
                self.recorded.add(step_key(step))

    def _log_recovered(self, step: int, record: dict[str, Any]) -> None:
        """Log step N's checks and training from its engine record, on the event thread."""
        checks = self.check(step, record["metrics"])
        metadata = train_metadata(
            record, record["metrics"], **checks, **step_upstream(step), recovered=True
        )
        self._log_now(step, step_materialization(TRAIN, step, metadata))


def run_trainer(
    context: dg.AssetExecutionContext,
    run_config: RunConfigResource,
    engine: EngineResource,
    steps: list[int],
) -> None:
    """`Trainer.train` up to the run's last step (or until the data ends)."""
    first, last = steps[0], run_last_step(context)
    hook = DagsterTrainerHook(context, run_config)
    trainer = Trainer(run_config.config, engine.wrapper(), hook)
    try:
        asyncio.run(trainer.prepare())
        at = trainer.train_step_num
        if at + 1 < first:
            raise dg.Failure(
                f"the engine is at step {at}: steps {at + 1}..{first - 1} must be trained "
                f"before step {first}; materialize them first"
            )
        hook.record_unlogged(list(range(first, (at if last is None else min(at, last)) + 1)))
        reason = asyncio.run(trainer.train(last_step=last))
    except SyncWithheldError as err:
        raise dg.Failure(str(err), metadata={"step": err.step}) from err
    finally:
        try:
            hook.close()
        finally:
            asyncio.run(trainer.shutdown())
    context.log.info(f"trainer loop stopped: {reason}")


def pin_batches(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, steps: list[int]
) -> None:
    """Pin the steps' batches and log each `experience_batch[N]` (no training)."""
    for step in steps:
        pinned = pin_batch(run_config.config, step)
        if isinstance(pinned, PinShortfall):
            raise dg.Failure(f"not enough experiences for step {step}: {pinned.message}")
        current = latest_weights_version(run_config.paths) or 0
        metadata = batch_metadata(batch_table(run_config, step, pinned), pinned, current)
        digest = data_version(batch_data_version(pinned.eids))
        context.log_event(step_materialization(BATCH, step, metadata, digest))
