"""The state of a long training run, built without training, for `bench scale`.

- `InstanceState` logs into a Dagster instance what the sensor and the trainer and explorer
  runs log for each step (real events through the instance, with the real per-step metadata
  builders of `assets/`): per window of `dagster.steps_per_run` steps one `train_job` and one
  `rollouts_job` run with the window's partitions and planned materialisations; per step
  `rollouts`, `experience_batch`, `train_step` with its two checks and `synced_weights`; per
  `trainer.save_interval` steps the runless `checkpoint` and `hf_model` records.
- `grow_tables` makes the Delta commits of the same steps through the real code: the
  explorer's `ExperienceWriter` (one explore step of the demo's shape, 256 rows of 32
  tokens) and the trainer's `pin_batch`, with the Delta maintenance the sensor launches every
  `dagster.maintenance_every_steps` steps; then it times the next steps' writes and pins and
  opening each table.
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.graph_names import ROLLOUTS_JOB, TRAIN_JOB

REPO_ROOT = Path(__file__).resolve().parents[1]
ROWS, PROMPT, RESPONSE, GROUP = 256, 24, 8, 8
# the metrics the demo's GRPO trainer reports each step (train_step's numeric metadata)
TRAIN_METRICS = (
    "time/read_experience",
    "time/train_step_call",
    "actor/loss",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "critic/advantages/mean",
    "response_length/mean",
    "perf/total_num_tokens",
    "actor/grad_norm",
    "actor/lr",
    "actor/sft",
    "time/train_step",
    "perf/throughput",
    "time/load_batch",
    "time/step",
)


def bench_config(root: Path, total_steps: int) -> Path:
    """The demo's configuration with its run root at `root`, for `total_steps`, as a file."""
    config = load_config(
        REPO_ROOT / "examples" / "demo.yaml",
        overrides={"run_root": str(root), "trainer.total_steps": total_steps},
    )
    path = root / "config.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_yaml())
    return path


class InstanceState:
    """Grows a Dagster instance step by step as a training run would."""

    def __init__(self, instance: Any, config: TrinityConfig) -> None:
        import dagster as dg

        from assets.definitions import defs
        from assets.jobs import rollouts_job, train_job

        self.dg = dg
        self.instance = instance
        self.config = config
        self.jobs = {job.name: defs.resolve_job_def(job.name) for job in (train_job, rollouts_job)}
        self.runs: dict[str, str] = {}
        self.step = 0
        self.window_first = 0
        self.rng = np.random.default_rng(0)

    def grow(self, to_step: int) -> None:
        """Log every step up to `to_step`."""
        for step in range(self.step + 1, to_step + 1):
            self.log_step(step)

    def log_step(self, step: int) -> None:
        """Log step N as the runs and the sensor do (a new window's runs first)."""
        if self.window_due(step):
            self.new_runs(step)
        self._rollouts(step)
        self._trained(step)
        interval = self.config.trainer.save_interval
        if interval and step % interval == 0:
            self._checkpoint(step)
        self.step = step

    def _event(self, run: str, event_type: Any, data: Any = None, step_key: str = "train") -> None:
        from dagster._core.events import DagsterEvent

        job = TRAIN_JOB if run == "train" else ROLLOUTS_JOB
        event = DagsterEvent(
            event_type_value=event_type.value,
            job_name=job,
            step_key=None if data is None else (step_key if run == "train" else "rollouts"),
            event_specific_data=data,
        )
        self.instance.report_dagster_event(event, self.runs[run], logging.INFO)

    def window_due(self, step: int) -> bool:
        """Whether step N starts a window whose runs are not made yet."""
        return (step - 1) % self.config.dagster.steps_per_run == 0 and self.window_first != step

    def new_runs(self, first: int) -> None:
        """End the window's runs; start the next window's, as the sensor and Dagster do."""
        from dagster._core.events import DagsterEventType

        from assets.partitions import STEP_PARTITIONS, step_key
        from assets.sensors import RANGE_END, RANGE_START

        dg = self.dg
        for run in list(self.runs):
            self._event(run, DagsterEventType.RUN_SUCCESS)
        self.window_first = first
        last = first + self.config.dagster.steps_per_run - 1
        keys = [step_key(s) for s in range(first, last + 1)]
        self.instance.add_dynamic_partitions(STEP_PARTITIONS, keys)
        tags = {RANGE_START: keys[0], RANGE_END: keys[-1]}
        for run, job in (("train", TRAIN_JOB), ("explore", ROLLOUTS_JOB)):
            # Dagster logs the run's planned materialisations (one per partition) here
            created = self.instance.create_run_for_job(
                job_def=self.jobs[job], tags=tags, status=dg.DagsterRunStatus.NOT_STARTED
            )
            self.runs[run] = created.run_id
            self._event(run, DagsterEventType.RUN_START)

    def _materialized(self, run: str, materialization: Any) -> None:
        from dagster._core.events import DagsterEventType, StepMaterializationData

        data = StepMaterializationData(materialization)
        self._event(run, DagsterEventType.ASSET_MATERIALIZATION, data)

    def _rollouts(self, step: int) -> None:
        from assets.step_runs import step_materialization
        from trinity_dagster.graph_names import ROLLOUTS

        rewards = self.rng.random(ROWS)
        metadata = {
            "weights_version": step - 1,
            "demonstrations": False,
            "written": ROWS,
            "quarantined": 0,
            "version": 2 * step,
            "already_written": False,
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards > 0.5).mean()),
            "time/wait_weights": 0.01,
            "time/generate": 0.1,
            "time/write_experiences": 0.02,
        }
        self._materialized("explore", step_materialization(ROLLOUTS, step, metadata))

    def _trained(self, step: int) -> None:
        from dagster._core.events import DagsterEventType

        from assets.lineage import INPUT_DATA_VERSION_TAG, data_version, step_upstream
        from assets.step_runs import step_materialization
        from assets.sync import sync_metadata
        from assets.train_loop import train_metadata
        from assets.training import CHECKS
        from trinity_dagster.graph_names import BATCH, SYNCED, TRAIN

        dg = self.dg
        digest = f"{self.rng.integers(2**63):016x}"
        batch = {
            "batch_size": ROWS,
            "groups": ROWS // GROUP,
            "reward_mean": float(self.rng.random()),
            "reward_std": 0.4,
            "reward_min": 0.0,
            "reward_max": 1.0,
            "source_table_version": 2 * step,
            "model_version_min": step - 1,
            "model_version_max": step - 1,
            "model_version_drift": 0,
            "already_pinned": False,
        }
        self._materialized("train", step_materialization(BATCH, step, batch, data_version(digest)))
        for name in CHECKS:
            evaluation = dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(TRAIN),
                check_name=name,
                passed=True,
                metadata={
                    "reason": "finite" if name == "loss_is_finite" else "within bound",
                    "step": step,
                },
                blocking=True,
            )
            self._event("train", DagsterEventType.ASSET_CHECK_EVALUATION, evaluation)
        record = {"parent_step": step - 1, "batch_size": ROWS, "health_problems": []}
        metrics = {name: float(self.rng.random()) for name in TRAIN_METRICS}
        metadata = train_metadata(
            record,
            metrics,
            **{f"check/{name}": "passed" for name in CHECKS},
            **step_upstream(step, {step - 1: ROWS}, 2 * step),
            weights_version=step,
            synced=True,
            saved=False,
        )
        tags = {INPUT_DATA_VERSION_TAG.format(BATCH): digest}
        self._materialized("train", step_materialization(TRAIN, step, metadata, tags))
        info = {"version": step, "path": f"/runs/weights/v{step}", "size_bytes": 2_100_000}
        self._materialized("train", step_materialization(SYNCED, step, sync_metadata(info)))

    def _checkpoint(self, step: int) -> None:
        """The sensor's runless records of a background checkpoint and its HF export."""
        from assets.lineage import partition_url, weights_table
        from assets.partitions import step_key
        from assets.weights import checkpoint_metadata
        from trinity_dagster.graph_names import CHECKPOINT, HF_MODEL, TRAIN

        dg = self.dg
        info = {
            "path": f"/runs/checkpoints/global_step_{step}",
            "size_bytes": 9_000_000,
            "files": 12,
            "manifest_sha256": f"{self.rng.integers(2**63):016x}",
        }
        metadata = {
            **checkpoint_metadata(info),
            "upstream/train_step": partition_url(TRAIN, step),
            "upstream/weights_versions": weights_table({v: ROWS for v in range(step - 5, step)}),
            "lineage/steps": f"1..{step} from the initial model, no gap",
            "lineage/experiences_trained": step * ROWS,
            "lineage/staleness_max": 1,
        }
        key = step_key(step)
        self.instance.report_runless_asset_event(
            dg.AssetMaterialization(CHECKPOINT, partition=key, metadata=metadata)
        )
        hf = {"path": dg.MetadataValue.path(f"{info['path']}/huggingface"), "size_bytes": 2_100_000}
        self.instance.report_runless_asset_event(
            dg.AssetMaterialization(HF_MODEL, partition=key, metadata=hf)
        )


def explore_rows(step: int, rng: np.random.Generator) -> pa.Table:
    """One explore step's experiences in the demo's shape (GRPO groups of 8)."""
    now = dt.datetime.now(dt.UTC)
    width = PROMPT + RESPONSE
    return pa.table(
        {
            "eid": [f"s{step}-{i}" for i in range(ROWS)],
            "task_id": [f"t{step}-{i // GROUP}" for i in range(ROWS)],
            "group_id": [f"g{step}-{i // GROUP}" for i in range(ROWS)],
            "explorer_id": ["explorer-0"] * ROWS,
            "tokens": list(rng.integers(1, 300, (ROWS, width), dtype=np.int32)),
            "prompt_length": np.full(ROWS, PROMPT, np.int32),
            "action_mask": list(np.ones((ROWS, RESPONSE), bool)),
            "logprobs": list(-rng.random((ROWS, RESPONSE), dtype=np.float32)),
            "reward": rng.random(ROWS),
            "model_version": np.full(ROWS, max(step - 1, 0), np.int64),
            "created_at": [now] * ROWS,
            "info": ["{}"] * ROWS,
        }
    )


def grow_tables(config_file: str, first: int, last: int, timed: int) -> dict[str, float]:
    """Explore and pin steps first..last, then `timed` more with each write and pin timed;
    returns the medians and the time to open each table (in seconds).

    Every `dagster.maintenance_every_steps` steps it runs the maintenance that the sensor's
    `delta_maintenance_job` run does.
    """
    from assets.maintenance import maintain
    from trinity_dagster.buffer import ExperienceWriter, PinResult, pin_batch
    from trinity_dagster.buffer.tables import open_table
    from trinity_dagster.lineage.ledger import update_ledger
    from trinity_dagster.paths import RunPaths

    config = load_config(config_file)
    paths = RunPaths.of_config(config)
    writer = ExperienceWriter(config)
    rng = np.random.default_rng(first)
    every = config.dagster.maintenance_every_steps
    writes, pins = [], []
    maintenance = []
    for step in range(first, last + timed + 1):
        rows = explore_rows(step, rng)
        started = time.perf_counter()
        report = writer.write(rows, explore_step=step)
        wrote = time.perf_counter()
        pinned = pin_batch(config, step)
        done = time.perf_counter()
        if report.written != ROWS or not isinstance(pinned, PinResult):
            raise RuntimeError(f"step {step}: wrote {report.written}, pinned {pinned}")
        if step > last:
            writes.append(wrote - started)
            pins.append(done - wrote)
        if every is not None and step % every == 0:
            started = time.perf_counter()
            maintain(config)
            maintenance.append(time.perf_counter() - started)
    opens = {}
    for name, location in (
        ("experiences", paths.experiences),
        ("batches", paths.batches),
        ("ledger_steps", paths.ledger_steps),
    ):
        times = []
        for _ in range(5):
            started = time.perf_counter()
            open_table(location)
            times.append(time.perf_counter() - started)
        opens[f"delta_open_{name}_s"] = statistics.median(times)
    started = time.perf_counter()
    update_ledger(paths)
    return {
        "delta_write_s": statistics.median(writes),
        "delta_pin_s": statistics.median(pins),
        **opens,
        "ledger_update_s": time.perf_counter() - started,
        "maintenance_s": max(maintenance, default=0.0),
        "delta_log_files": float(len(list(Path(paths.batches, "_delta_log").iterdir()))),
    }
