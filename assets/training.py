"""`experience_batch` and `train_step`: pin step N's experiences, then train step N on them.

Both live in one op so that a run over steps a..b pins and trains each step in turn
(step N+1 is pinned after step N trained) and logs each step's own metadata. Either asset
can be materialised alone. The engine enforces the order across steps; the parent step is
recorded on `train_step`. The blocking checks `loss_is_finite` and `kl_within_bound` stop
the sync of a bad step's weights.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pyarrow.compute as pc

from assets.partitions import step_partitions
from assets.steps import numeric_metadata, run_steps, step_materialization
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.buffer.sampler import NotEnoughData, pin_batch
from trinity_dagster.checkpoint.layout import latest_weights_version
from trinity_dagster.step_checks import kl_within_bound, loss_is_finite

ENGINE_POOL = "engine"
BATCH = "experience_batch"
TRAIN = "train_step"


def batch_metadata(run_config: RunConfigResource, step: int, pinned: Any) -> dict[str, Any]:
    """Size, reward statistics, source table version and staleness of step N's batch."""
    table = load_step_batch(run_config.config, step)
    rewards = table.column("reward")
    versions = table.column("model_version")
    current = latest_weights_version(run_config.paths) or 0
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


def train_metadata(record: dict[str, Any]) -> dict[str, Any]:
    """Every numeric metric of the step, plus lineage and what was saved and synced."""
    return {
        **numeric_metadata(record["metrics"]),
        "parent_step": record["parent_step"],
        "batch_size": record["batch_size"],
        "weights_version": record["weights_version"],
        "saved": record["saved"],
        "saved_hf": record["saved_hf"],
        "synced": record["synced"],
        "sync_withheld": "; ".join(record["sync_withheld"]),
        "replayed_steps": ",".join(str(s) for s in record.get("replayed", [])),
        "already_trained": record.get("already_trained", False),
    }


@dg.multi_asset(
    name="train",
    specs=[
        dg.AssetSpec(
            BATCH,
            deps=["experiences"],
            skippable=True,
            partitions_def=step_partitions,
            group_name="training",
            kinds={"deltalake"},
            description="The experiences pinned to step N (idempotent; replayable).",
        ),
        dg.AssetSpec(
            TRAIN,
            deps=[BATCH],
            skippable=True,
            partitions_def=step_partitions,
            group_name="training",
            kinds={"pytorch"},
            description="The engine trained step N on its pinned batch; metadata: every metric.",
        ),
    ],
    check_specs=[
        dg.AssetCheckSpec("loss_is_finite", asset=TRAIN, blocking=True),
        dg.AssetCheckSpec("kl_within_bound", asset=TRAIN, blocking=True),
    ],
    can_subset=True,
    backfill_policy=dg.BackfillPolicy.single_run(),
    pool=ENGINE_POOL,
)
def train(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, engine: EngineResource
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckResult]:
    """Pin and/or train each step of the run, in order."""
    selected = {key.to_user_string() for key in context.selected_asset_keys}
    config = run_config.config
    failures: dict[str, list[str]] = {"loss_is_finite": [], "kl_within_bound": []}
    for step in run_steps(context):
        if BATCH in selected:
            pinned = pin_batch(config, step)
            if isinstance(pinned, NotEnoughData):
                raise dg.Failure(
                    f"not enough experiences for step {step}: {pinned.message}",
                    metadata={"have": pinned.have, "need": pinned.need},
                )
            yield step_materialization(BATCH, step, batch_metadata(run_config, step, pinned))
        if TRAIN in selected:
            record = engine.train_step(step)
            yield step_materialization(TRAIN, step, train_metadata(record))
            metrics = record["metrics"]
            for name, (ok, reason) in {
                "loss_is_finite": loss_is_finite(metrics),
                "kl_within_bound": kl_within_bound(metrics, config.algorithm.kl_bound),
            }.items():
                if not ok:
                    failures[name].append(f"step {step}: {reason}")
    if TRAIN in selected:
        for name, problems in failures.items():
            yield dg.AssetCheckResult(
                asset_key=TRAIN,
                check_name=name,
                passed=not problems,
                metadata={"problems": "; ".join(problems) or "none"},
            )
