"""Scheduled maintenance: Delta table compaction and vacuum, checkpoint retention."""

import dagster as dg

from resources.run_config import RunConfigResource, load_run_config
from trinity_dagster.buffer.maintenance import compact, vacuum
from trinity_dagster.checkpoint import retention
from trinity_dagster.checkpoint.rules import sft_model_step

_config = load_run_config()
_STATUS = (
    dg.DefaultScheduleStatus.RUNNING
    if _config.dagster.schedules_running
    else dg.DefaultScheduleStatus.STOPPED
)


@dg.op(description="Compact and vacuum the experience, batch and quarantine tables.")
def maintain_delta_tables(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """Compaction then vacuum; pinned batches stay replayable (they are stored in `batches`).

    Vacuum uses this run's `dagster.vacuum_retention_hours`, which overrides Delta's minimum.
    """
    config = run_config.config
    compacted = compact(config)
    vacuumed = vacuum(
        config,
        retention_hours=config.dagster.vacuum_retention_hours,
        enforce_retention_duration=False,
    )
    context.log.info(f"compacted: {compacted}; vacuumed: {vacuumed}")


@dg.op(description="Delete checkpoints beyond trainer.max_checkpoints_to_keep.")
def prune_old_checkpoints(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """Retention counted from what is on disk; never the newest checkpoint that verifies,
    nor the SFT model's."""
    config = run_config.config
    deleted = retention.prune_checkpoints(
        run_config.paths,
        config.trainer.max_checkpoints_to_keep,
        keep_step=sft_model_step(config),
    )
    context.log.info(f"deleted checkpoints: {deleted or 'none'}")


@dg.job(description="Delta maintenance: compaction and vacuum.")
def delta_maintenance_job() -> None:
    maintain_delta_tables()


@dg.job(description="Checkpoint retention.")
def checkpoint_retention_job() -> None:
    prune_old_checkpoints()


delta_maintenance_schedule = dg.ScheduleDefinition(
    name="delta_maintenance",
    job=delta_maintenance_job,
    cron_schedule=_config.dagster.maintenance_cron,
    default_status=_STATUS,
)
checkpoint_retention_schedule = dg.ScheduleDefinition(
    name="checkpoint_retention",
    job=checkpoint_retention_job,
    cron_schedule=_config.dagster.maintenance_cron,
    default_status=_STATUS,
)
