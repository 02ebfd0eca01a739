"""The built-in explorer in the graph: `rollouts` per explore step and `evaluation` per step.

A run of `rollouts` over explore steps a..b runs the built-in explorer loop
(`trinity_dagster.explorer.loop`): it waits for the weights each step may use, generates
experiences, appends them to the `experiences` table and logs `rollouts[E]` with the weights
version, so lineage shows which weights produced which experiences. During the SFT warm-up
(`trainer.sft_warmup_steps`) it writes demonstrations. A retried run skips recorded steps.
Once it explored every step the trainer needs, the run waits for training to finish and
scores it (`score_finished_run`): the end-of-training evaluations and `trained_exactly_once`.
`evaluation[V]` scores weights version V on the held-out task set with greedy decoding, beside
training (it takes no pool slot); its partitions are weights versions, so version 0 (the
initial model) adds no untrainable step partition. The version is held against pruning while
it loads; a failure names its cause in the run's page.
The explorer (torch, transformers) is imported inside the assets, never at load time.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from assets.lineage import trained_once_evaluation
from assets.partitions import (
    WEIGHTS_PARTITIONS,
    step_key,
    step_of,
    step_partitions,
    weights_partitions,
)
from assets.step_runs import StepPartitions, run_last_step, run_steps, step_materialization
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.layout import latest_checkpoint_step
from trinity_dagster.graph_names import EVALUATION, ROLLOUTS, SYNCED
from trinity_dagster.handoff.end_of_data import end_of_data
from trinity_dagster.handoff.heartbeat import BUILTIN_EXPLORER_ID, Heartbeat
from trinity_dagster.handoff.trainer_state import finished_training, wait_for_training_end


@dg.multi_asset(
    name="explore",
    specs=[
        dg.AssetSpec(
            ROLLOUTS,
            skippable=True,
            partitions_def=step_partitions,
            group_name="experience",
            kinds={"transformers", "deltalake"},
            description="Experiences of explore step E, written to `experiences` (weights v).",
        )
    ],
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def rollouts(
    context: dg.AssetExecutionContext, run_config: RunConfigResource
) -> Iterator[dg.Output]:
    """The built-in explorer loop over the run's explore steps, one model kept loaded."""
    from trinity_dagster.explorer.loop import ExplorerLoop, explorer_threads_here

    partitions = StepPartitions(context.instance)

    def log_step(step: int, metadata: dict) -> None:
        partitions.ensure(step)
        context.log_event(step_materialization(ROLLOUTS, step, metadata))

    done = {
        step_of(key) for key in context.instance.get_materialized_partitions(dg.AssetKey(ROLLOUTS))
    }
    threads = explorer_threads_here(run_config.config)
    context.log.info(f"explorer: {threads} torch thread(s) (explorer.torch_threads)")
    loop = ExplorerLoop(run_config.config, on_step=log_step)
    try:
        reason = loop.run(run_steps(context)[0], run_last_step(context), done)
    finally:
        loop.close()
    context.log.info(f"explorer loop stopped: {reason}")
    paths, total = run_config.paths, run_config.config.trainer.total_steps
    if end_of_data(paths) is not None or finished_training(paths, total) is not None:
        score_finished_run(context, run_config)
    yield from ()  # each step was logged as it finished; there is no output at the end


def score_finished_run(context: dg.AssetExecutionContext, run_config: RunConfigResource) -> None:
    """Once training finished: `evaluation[v]` of the versions `versions_to_evaluate` names
    and the `trained_exactly_once` check, logged from this run, whose process has torch and
    transformers loaded, so no run worker starts for them. It waits only while a trainer
    loop runs; what it does not score (no trainer loop ran, an evaluation failed, this run
    was ended) the sensor launches runs for."""
    from trinity_dagster.checkpoint.layout import latest_weights_version
    from trinity_dagster.explorer.eval_versions import versions_to_evaluate

    paths, config = run_config.paths, run_config.config
    heartbeat = Heartbeat(paths, BUILTIN_EXPLORER_ID)
    context.log.info("explorer: waiting for training to finish, to score the run")
    if (
        wait_for_training_end(paths, config.trainer.total_steps, while_waiting=heartbeat.beat)
        is None
    ):
        context.log.info("explorer: no trainer loop runs; the sensor scores the run when it ends")
        return
    final = latest_weights_version(paths) or 0
    done = context.instance.get_materialized_partitions(dg.AssetKey(EVALUATION))
    for version in versions_to_evaluate(config, paths, final):
        key = step_key(version)
        if key in done:
            continue
        try:
            metadata = evaluation_metadata(run_config, version)
        except Exception as err:  # the sensor's evaluation run reports it in its own page
            context.log.warning(f"evaluation of weights version {version} failed here: {err}")
            continue
        if not context.instance.has_dynamic_partition(WEIGHTS_PARTITIONS, key):
            context.instance.add_dynamic_partitions(WEIGHTS_PARTITIONS, [key])
        context.log_event(dg.AssetMaterialization(EVALUATION, partition=key, metadata=metadata))
    context.log_event(trained_once_evaluation(run_config))


def evaluation_metadata(run_config: RunConfigResource, version: int) -> dict[str, Any]:
    """What `evaluation[version]` records: the held-out metrics and the weights version."""
    from trinity_dagster.explorer.evaluation import evaluate

    metrics = evaluate(run_config.config, run_config.paths, version)
    return {**metrics, "weights_version": version}


@dg.asset(
    name=EVALUATION,
    partitions_def=weights_partitions,
    deps=[dg.AssetDep(SYNCED, partition_mapping=dg.IdentityPartitionMapping())],
    group_name="evaluation",
    kinds={"transformers"},
    description="Held-out accuracy of weights version N (greedy decoding).",
)
def evaluation(
    context: dg.AssetExecutionContext, run_config: RunConfigResource
) -> dg.MaterializeResult:
    """`eval/<taskset>/accuracy` and `eval/<taskset>/reward/mean` of weights version N."""
    version = step_of(context.partition_key)
    try:
        metadata = evaluation_metadata(run_config, version)
    except Exception as err:
        raise dg.Failure(
            f"evaluation of weights version {version} failed: {type(err).__name__}: {err}"
        ) from err
    return dg.MaterializeResult(metadata=metadata)


def evaluate_newest_checkpoint(
    context: dg.ScheduleEvaluationContext, run_config: RunConfigResource
) -> dg.RunRequest | dg.SkipReason:
    """Evaluate the newest complete checkpoint once."""
    step = latest_checkpoint_step(run_config.paths)
    if step is None:
        return dg.SkipReason("no complete checkpoint yet")
    key = step_key(step)
    context.instance.add_dynamic_partitions(WEIGHTS_PARTITIONS, [key])
    return dg.RunRequest(run_key=f"eval-{key}", partition_key=key)
