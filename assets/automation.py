"""The code location's sensor and schedules, built from the run config's `dagster` section
(intervals, cron strings, whether each is on when the location loads)."""

import dagster as dg

from assets.explore import evaluate_newest_checkpoint
from assets.jobs import evaluation_job, rollouts_job, train_job
from assets.lineage import lineage_check_job
from assets.maintenance import checkpoint_retention_job, delta_maintenance_job
from assets.sensors import evaluate_rft_loop
from trinity_dagster.config import DagsterConfig
from trinity_dagster.graph_names import LOOP_SENSOR


def build_rft_loop_sensor(settings: DagsterConfig) -> dg.SensorDefinition:
    """`rft_loop_sensor` as the daemon runs it: every `settings.sensor_interval_s`, on at
    load when `settings.sensors_running`."""
    return dg.sensor(
        name=LOOP_SENSOR,
        jobs=[train_job, rollouts_job, evaluation_job, lineage_check_job, delta_maintenance_job],
        minimum_interval_seconds=settings.sensor_interval_s,
        default_status=(
            dg.DefaultSensorStatus.RUNNING
            if settings.sensors_running
            else dg.DefaultSensorStatus.STOPPED
        ),
        description=(
            "Keep the trainer run (and the built-in explorer run) going, record checkpoints as "
            "their manifests land, and at the end evaluate the initial, SFT and final weights "
            "and check that every experience trained exactly once."
        ),
    )(evaluate_rft_loop)


def build_schedules(settings: DagsterConfig) -> list[dg.ScheduleDefinition]:
    """Delta maintenance and checkpoint retention on `settings.maintenance_cron`, the newest
    checkpoint's evaluation on `settings.eval_cron`; on at load when
    `settings.schedules_running`."""
    status = (
        dg.DefaultScheduleStatus.RUNNING
        if settings.schedules_running
        else dg.DefaultScheduleStatus.STOPPED
    )
    return [
        dg.ScheduleDefinition(
            name="delta_maintenance",
            job=delta_maintenance_job,
            cron_schedule=settings.maintenance_cron,
            default_status=status,
        ),
        dg.ScheduleDefinition(
            name="checkpoint_retention",
            job=checkpoint_retention_job,
            cron_schedule=settings.maintenance_cron,
            default_status=status,
        ),
        dg.schedule(
            name="evaluate_newest_checkpoint",
            job=evaluation_job,
            cron_schedule=settings.eval_cron,
            default_status=status,
        )(evaluate_newest_checkpoint),
    ]
