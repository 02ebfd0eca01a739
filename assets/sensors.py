"""Sensors that drive training: data -> train, trained -> sync, trained -> save.

Each keeps a cursor and gives every run request a run key, so a tick never launches the
same work twice, even after a restart of the daemon or the sensor.
"""

import dagster as dg

from assets.jobs import save_job, save_with_hf_job, sync_job, train_job
from assets.partitions import step_key, step_of, step_partitions
from assets.training import TRAIN
from resources.run_config import RunConfigResource, load_run_config
from trinity_dagster.buffer.stats import unconsumed_count

_config = load_run_config()
_STATUS = (
    dg.DefaultSensorStatus.RUNNING
    if _config.dagster.sensors_running
    else dg.DefaultSensorStatus.STOPPED
)
_INTERVAL = _config.dagster.sensor_interval_s


def newest_trained_step(instance: dg.DagsterInstance) -> int:
    """The highest step whose `train_step` partition is materialised (0 if none)."""
    keys = instance.get_materialized_partitions(dg.AssetKey(TRAIN))
    return max((step_of(key) for key in keys), default=0)


@dg.sensor(
    name="data_sensor",
    job=train_job,
    minimum_interval_seconds=_INTERVAL,
    default_status=_STATUS,
    description="Enough unconsumed experiences -> add step N and pin + train it.",
)
def data_sensor(
    context: dg.SensorEvaluationContext, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """Request step N once step N-1 trained and enough experiences wait in the buffer."""
    config = run_config.config
    requested = int(context.cursor or 0)
    trained = newest_trained_step(context.instance)
    if requested > trained:
        return dg.SkipReason(f"waiting for train_step {step_key(requested)} to finish")
    step = trained + 1
    if step > config.trainer.total_steps:
        return dg.SkipReason(f"all {config.trainer.total_steps} steps are trained")
    have = unconsumed_count(config)
    need = config.buffer.train_batch_size
    if have < need:
        return dg.SkipReason(f"step {step}: have {have} unconsumed experiences, need {need}")
    key = step_key(step)
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"train-{key}", partition_key=key)],
        dynamic_partitions_requests=[step_partitions.build_add_request([key])],
        cursor=str(step),
    )


def _trained_events(
    context: dg.SensorEvaluationContext,
) -> tuple[list[tuple[str, dict]], str | None]:
    """New `train_step` materialisations since the cursor: (partition, metadata) pairs."""
    result = context.instance.fetch_materializations(
        dg.AssetKey(TRAIN), limit=200, cursor=context.cursor, ascending=True
    )
    events = []
    for record in result.records:
        materialization = record.asset_materialization
        if materialization is None or materialization.partition is None:
            continue
        metadata = {name: value.value for name, value in materialization.metadata.items()}
        events.append((materialization.partition, metadata))
    return events, result.cursor if result.records else context.cursor


@dg.sensor(
    name="sync_sensor",
    jobs=[sync_job],
    minimum_interval_seconds=_INTERVAL,
    default_status=_STATUS,
    description="train_step[N] done and its weights are to be synced -> synced_weights[N].",
)
def sync_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """Request `synced_weights[N]` for each newly trained step whose plan synced it."""
    events, cursor = _trained_events(context)
    requests = [
        dg.RunRequest(run_key=f"sync-{key}", partition_key=key, job_name=sync_job.name)
        for key, metadata in events
        if metadata.get("synced")
    ]
    return dg.SensorResult(run_requests=requests, cursor=cursor)


@dg.sensor(
    name="save_sensor",
    jobs=[save_job, save_with_hf_job],
    minimum_interval_seconds=_INTERVAL,
    default_status=_STATUS,
    description="need_save(N) or final step -> checkpoint[N] (and hf_model[N]).",
)
def save_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """Request `checkpoint[N]` (+ `hf_model[N]`) for each newly trained step that saved."""
    events, cursor = _trained_events(context)
    requests = [
        dg.RunRequest(
            run_key=f"save-{key}",
            partition_key=key,
            job_name=(save_with_hf_job if metadata.get("saved_hf") else save_job).name,
        )
        for key, metadata in events
        if metadata.get("saved")
    ]
    return dg.SensorResult(run_requests=requests, cursor=cursor)
