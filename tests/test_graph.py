"""The Dagster graph in process: assets against a real engine service, sensors with cursors."""

import math
from pathlib import Path

import dagster as dg
import pytest

from assets.experiences import experience_schema, experiences
from assets.sensors import data_sensor, save_sensor, sync_sensor
from assets.training import train
from assets.weights import save, sync
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from tests.run_helpers import fill_buffer, tiny_config
from trinity_dagster.checkpoint.layout import checkpoint_dir
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


@pytest.fixture
def graph(tmp_path: Path):
    config, config_file = tiny_config(
        tmp_path, {"trainer": {"total_steps": 4, "save_interval": 2, "save_hf_checkpoint": "last"}}
    )
    run_config = RunConfigResource(config_path=str(config_file))
    resources = {"run_config": run_config, "engine": EngineResource(run_config=run_config)}
    with dg.instance_for_test() as instance:
        yield config, resources, instance
    stop_service(RunPaths.of(config.run_root))


def sensor_result(sensor, instance, resources, cursor=None):
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"run_config": resources["run_config"]}
    )
    return sensor(context)


def metadata(instance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def check_passed(result: dg.ExecuteInProcessResult, name: str) -> bool:
    evaluations = [
        e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return all(e.passed for e in evaluations if e.check_name == name) and any(
        e.check_name == name for e in evaluations
    )


def test_graph_trains_syncs_and_saves_through_sensors(graph) -> None:
    config, resources, instance = graph
    paths = RunPaths.of(config.run_root)

    waiting = sensor_result(data_sensor, instance, resources)
    assert isinstance(waiting, dg.SkipReason) and "have 0" in waiting.skip_message
    fill_buffer(config, steps=config.trainer.total_steps)

    first = sensor_result(data_sensor, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["000001"]
    assert first.dynamic_partitions_requests[0].partition_keys == ["000001"]
    again = sensor_result(data_sensor, instance, resources, cursor=first.cursor)
    assert isinstance(again, dg.SkipReason) and "waiting for train_step 000001" in (
        again.skip_message
    )
    instance.add_dynamic_partitions("step", ["000001", "000002", "000003", "000004"])

    one = dg.materialize([train], instance=instance, resources=resources, partition_key="000001")
    assert one.success
    step1 = metadata(instance, "train_step", "000001")
    assert math.isfinite(step1["actor/pg_loss"]) and step1["parent_step"] == 0
    assert step1["batch_size"] == config.buffer.train_batch_size
    assert metadata(instance, "experience_batch", "000001")["batch_size"] == 8
    assert check_passed(one, "loss_is_finite") and check_passed(one, "kl_within_bound")

    # a restarted data sensor (no cursor) asks for the next step, not the trained one
    restarted = sensor_result(data_sensor, instance, resources)
    assert [r.run_key for r in restarted.run_requests] == ["train-000002"]

    # single-run backfill of steps 2..4: one materialisation per step, each its own metadata
    ranged = dg.materialize(
        [train],
        instance=instance,
        resources=resources,
        tags={RANGE_START: "000002", RANGE_END: "000004"},
    )
    assert ranged.success
    steps = [metadata(instance, "train_step", f"00000{n}") for n in (2, 3, 4)]
    assert [m["parent_step"] for m in steps] == [1, 2, 3]
    assert len({m["actor/pg_loss"] for m in steps}) == 3

    syncs = sensor_result(sync_sensor, instance, resources)
    assert [r.run_key for r in syncs.run_requests] == [f"sync-00000{n}" for n in (1, 2, 3, 4)]
    assert (
        sync_sensor(dg.build_sensor_context(instance=instance, cursor=syncs.cursor)).run_requests
        == []
    )  # restarted with its cursor: nothing twice

    synced = dg.materialize([sync], instance=instance, resources=resources, partition_key="000001")
    assert synced.success
    assert metadata(instance, "synced_weights", "000001")["version"] == 1

    saves = sensor_result(save_sensor, instance, resources)
    # save_interval 2 and the final step; with sync_interval 1 and sync_method checkpoint
    # each save also serves as the sync, so it carries the HF export explorers load
    assert [(r.run_key, r.job_name) for r in saves.run_requests] == [
        ("save-000002", "save_with_hf_job"),
        ("save-000004", "save_with_hf_job"),
    ]
    saved = dg.materialize([save], instance=instance, resources=resources, partition_key="000004")
    assert saved.success and check_passed(saved, "checkpoint_complete")
    ckpt = metadata(instance, "checkpoint", "000004")
    assert Path(ckpt["path"]) == checkpoint_dir(paths, 4) and ckpt["size_bytes"] > 0
    hf = metadata(instance, "hf_model", "000004")
    assert (Path(hf["path"]) / "config.json").is_file()

    observe_and_check = dg.Definitions(
        assets=[experiences],
        asset_checks=[experience_schema],
        jobs=[
            dg.define_asset_job("observe", selection=[experiences]),
            dg.define_asset_job("check", selection=dg.AssetSelection.checks(experience_schema)),
        ],
        resources=resources,
    )
    observed = observe_and_check.resolve_job_def("observe").execute_in_process(instance=instance)
    assert observed.success
    observation = instance.fetch_observations(dg.AssetKey("experiences"), limit=1).records[0]
    stats = {k: v.value for k, v in observation.asset_observation.metadata.items()}
    assert stats["row_count"] == 4 * config.buffer.train_batch_size
    assert stats["unconsumed"] == 0
    checked = observe_and_check.resolve_job_def("check").execute_in_process(instance=instance)
    assert check_passed(checked, "experience_schema")


def test_engine_errors_fail_the_run_with_the_cause(graph) -> None:
    config, resources, instance = graph
    fill_buffer(config, steps=1)
    instance.add_dynamic_partitions("step", ["000003"])
    result = dg.materialize(
        [train],
        instance=instance,
        resources=resources,
        partition_key="000003",
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    text = str(failure.event_specific_data.error)
    assert "step 3" in text
