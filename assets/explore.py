"""The built-in explorer in the graph: `rollouts` per explore step and `evaluation` per step.

`rollouts[E]` generates experiences with the newest published weights (at least the version
explore step E may use, DESIGN §5 `sync_offset`) and appends them to the `experiences` table;
its metadata records the weights version, so lineage shows which weights produced which
experiences. During the SFT warm-up (`trainer.sft_warmup_steps`) it writes demonstrations.
`evaluation[N]` scores weights version N on the held-out task set with greedy decoding.
The explorer (torch, transformers) is imported inside the assets, never at load time.
"""

from statistics import fmean

import dagster as dg

from assets.jobs import evaluation_job, rollouts_job
from assets.partitions import step_key, step_of, step_partitions
from resources.run_config import RunConfigResource, load_run_config
from trinity_dagster.checkpoint.layout import latest_checkpoint_step, latest_weights_version
from trinity_dagster.checkpoint.rules import explorer_weights_version

ROLLOUTS = "rollouts"
EVALUATION = "evaluation"

_config = load_run_config()


def required_version(run_config: RunConfigResource, explore_step: int) -> int:
    """The oldest weights version explore step E may run with."""
    sync = run_config.config.synchronizer
    return explorer_weights_version(
        explore_step, sync_interval=sync.sync_interval, sync_offset=sync.sync_offset
    )


@dg.asset(
    name=ROLLOUTS,
    partitions_def=step_partitions,
    group_name="experience",
    kinds={"transformers", "deltalake"},
    description="Experiences of explore step E, written to `experiences` (weights version v).",
)
def rollouts(
    context: dg.AssetExecutionContext, run_config: RunConfigResource
) -> dg.MaterializeResult:
    """Explore step E (or write demonstrations during the SFT warm-up) into the buffer."""
    from trinity_dagster.buffer.writer import ExperienceWriter
    from trinity_dagster.explorer.demonstrations import demonstration_rows
    from trinity_dagster.explorer.explorer import Explorer

    config, paths = run_config.config, run_config.paths
    step = step_of(context.partition_key)
    version = latest_weights_version(paths) or 0
    needed = required_version(run_config, step)
    if version < needed:
        raise dg.Failure(
            f"explore step {step} needs weights version >= {needed}; the newest published "
            f"version is {version}"
        )
    demonstrations = step <= config.trainer.sft_warmup_steps
    if demonstrations:
        rows = demonstration_rows(
            config, config.buffer.train_batch_size, seed=step, model_version=version
        )
    else:
        rows = Explorer(config, paths).explore(step, version)
    report = ExperienceWriter(config, known_versions=lambda: set(range(version + 1))).write(rows)
    if report.written == 0:
        raise dg.Failure(
            f"explore step {step}: every experience was quarantined",
            metadata={"reasons": "; ".join(str(r) for r in report.reasons[:5])},
        )
    rewards = [row["reward"] for row in rows]
    return dg.MaterializeResult(
        metadata={
            "weights_version": version,
            "demonstrations": demonstrations,
            **report.as_metadata(),
            "reward_mean": fmean(rewards),
            "accuracy": fmean(1.0 if r >= 1.0 else 0.0 for r in rewards),
        }
    )


@dg.asset(
    name=EVALUATION,
    partitions_def=step_partitions,
    deps=["synced_weights"],
    group_name="evaluation",
    kinds={"transformers"},
    description="Held-out accuracy of weights version N (greedy decoding).",
)
def evaluation(
    context: dg.AssetExecutionContext, run_config: RunConfigResource
) -> dg.MaterializeResult:
    """`eval/<taskset>/accuracy` and `eval/<taskset>/reward/mean` of weights version N."""
    from trinity_dagster.explorer.evaluation import evaluate

    version = step_of(context.partition_key)
    metrics = evaluate(run_config.config, run_config.paths, version)
    return dg.MaterializeResult(metadata={**metrics, "weights_version": version})


@dg.sensor(
    name="rollouts_sensor",
    job=rollouts_job,
    minimum_interval_seconds=_config.dagster.sensor_interval_s,
    default_status=(
        dg.DefaultSensorStatus.RUNNING
        if _config.dagster.sensors_running and _config.dagster.builtin_explorer
        else dg.DefaultSensorStatus.STOPPED
    ),
    description="Weights for explore step E are published -> rollouts[E].",
)
def rollouts_sensor(
    context: dg.SensorEvaluationContext, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """Request explore step E once the previous one finished and its weights exist."""
    requested = int(context.cursor or 0)
    done = context.instance.get_materialized_partitions(dg.AssetKey(ROLLOUTS))
    if requested and step_key(requested) not in done:
        return dg.SkipReason(f"waiting for rollouts {step_key(requested)}")
    step = requested + 1
    if step > run_config.config.trainer.total_steps:
        return dg.SkipReason("every explore step is done")
    version = latest_weights_version(run_config.paths) or 0
    needed = required_version(run_config, step)
    if version < needed:
        return dg.SkipReason(f"explore step {step} waits for weights version {needed}")
    key = step_key(step)
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"rollouts-{key}", partition_key=key)],
        dynamic_partitions_requests=[step_partitions.build_add_request([key])],
        cursor=str(step),
    )


@dg.schedule(
    name="evaluate_newest_checkpoint",
    job=evaluation_job,
    cron_schedule=_config.dagster.eval_cron,
    default_status=(
        dg.DefaultScheduleStatus.RUNNING
        if _config.dagster.schedules_running
        else dg.DefaultScheduleStatus.STOPPED
    ),
)
def evaluate_newest_checkpoint(
    context: dg.ScheduleEvaluationContext, run_config: RunConfigResource
) -> dg.RunRequest | dg.SkipReason:
    """Evaluate the newest complete checkpoint once."""
    step = latest_checkpoint_step(run_config.paths)
    if step is None:
        return dg.SkipReason("no complete checkpoint yet")
    key = step_key(step)
    return dg.RunRequest(run_key=f"eval-{key}", partition_key=key)
