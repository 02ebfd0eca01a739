"""`experience_batch` and `train_step`: the trainer loop as one multi-asset.

A run of `train` over steps a..b executes `Trainer.train` (trinity_dagster.trainer) up to b:
it waits for each step's data, trains it, syncs and saves as due, and logs
`experience_batch[N]`, `train_step[N]` (every metric), the step's health checks and
`synced_weights[N]` (when the loop published weights) as each step finishes, whatever
subset of them the run selected, so a long-lived run over 1..total_steps shows progress
and check results step by step, a backfill leaves no hole in the lineage, and a failure at
step k leaves a..k-1 recorded. Background checkpoints are recorded by `rft_loop_sensor` when
their manifests land. Selected alone, `experience_batch` pins the steps' batches.

A retried run (after its worker was killed) first records the steps the engine trained
without them being logged, then goes on from the engine's step: nothing trains twice.
The loop and its hook are in `assets.train_loop`, imported when the asset runs.
"""

from collections.abc import Iterator

import dagster as dg

from assets.partitions import step_partitions
from assets.step_runs import run_steps
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.graph_names import BATCH, TRAIN

ENGINE_POOL = "engine"
CHECKS = ("loss_is_finite", "kl_within_bound")


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
    check_specs=[dg.AssetCheckSpec(name, asset=TRAIN, blocking=True) for name in CHECKS],
    can_subset=True,
    backfill_policy=dg.BackfillPolicy.single_run(),
    pool=ENGINE_POOL,
)
def train(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, engine: EngineResource
) -> Iterator[dg.AssetCheckResult]:
    """Run the trainer loop over the run's steps (or pin their batches alone)."""
    from assets import train_loop  # the loop and the data libraries, in the run worker only

    selected = {key.to_user_string() for key in context.selected_asset_keys}
    steps = run_steps(context)
    if TRAIN in selected:
        train_loop.run_trainer(context, run_config, engine, steps)
    else:
        train_loop.pin_batches(context, run_config, steps)
    yield from ()  # each step and its checks were logged as the step finished
