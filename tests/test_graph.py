"""The Dagster graph in process: the trainer loop as ranged runs against a real engine service,
and the sensor that starts it and records its checkpoints."""

import math
from pathlib import Path

import dagster as dg
import pytest

from assets.automation import build_rft_loop_sensor
from assets.experiences import experience_schema, experiences
from assets.explore import rollouts
from assets.sensors import checkpoint_records, trainer_request
from assets.training import train
from assets.weights import save
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.layout import checkpoint_dir, set_latest_weights_version
from trinity_dagster.checkpoint.manifest import build_manifest, write_manifest
from trinity_dagster.commands.instance_progress import metadata_values
from trinity_dagster.graph_names import UNTIL_DATA_ENDS_TAG
from trinity_dagster.handoff.heartbeat import BUILTIN_EXPLORER_ID, seconds_since_beat
from trinity_dagster.handoff.trainer_state import DATA_ENDED, read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.testing import fill_buffer, tiny_config

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


@pytest.fixture
def graph(tmp_path: Path):
    config, config_file = tiny_config(
        tmp_path,
        {
            "trainer": {"total_steps": 4, "save_interval": 2, "save_hf_checkpoint": "last"},
            # fill_buffer's logprobs are random, not the policy's: its KL exceeds the default
            "algorithm": {"kl_bound": 100.0},
        },
    )
    run_config = RunConfigResource(config_path=str(config_file))
    resources = {"run_config": run_config, "engine": EngineResource(run_config=run_config)}
    with dg.instance_for_test() as instance:
        yield config, resources, instance
    stop_service(RunPaths.of(config.run_root))


def metadata(instance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    return metadata_values(records[0].asset_materialization)


def check_passed(result: dg.ExecuteInProcessResult, name: str) -> bool:
    evaluations = [
        e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return all(e.passed for e in evaluations if e.check_name == name) and any(
        e.check_name == name for e in evaluations
    )


def test_graph_trains_ranges_and_records_checkpoints(graph) -> None:
    config, resources, instance = graph
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, steps=config.trainer.total_steps)
    keys = [f"00000{n}" for n in (1, 2, 3, 4)]

    # one evaluation of the sensor starts the trainer run and the built-in explorer's
    context = dg.build_sensor_context(
        instance=instance, resources={"run_config": resources["run_config"]}
    )
    sensor = build_rft_loop_sensor(config.dagster)
    first = sensor.evaluate_tick(context)  # as the daemon does, with its checks
    requests = {request.job_name: request for request in first.run_requests}
    assert set(requests) == {"train_job", "rollouts_job"}
    request = requests["train_job"]
    assert (request.tags[RANGE_START], request.tags[RANGE_END]) == ("000001", "000004")
    # one request per partitions definition: Dagster refuses a key added twice
    by_def = {r.partitions_def_name: r for r in first.dynamic_partitions_requests}
    assert len(by_def) == len(first.dynamic_partitions_requests)
    partitions = by_def["step"]
    assert partitions.partition_keys == keys
    instance.add_dynamic_partitions("step", keys)

    one = dg.materialize([train], instance=instance, resources=resources, partition_key="000001")
    assert one.success
    step1 = metadata(instance, "train_step", "000001")
    assert math.isfinite(step1["actor/pg_loss"]) and step1["parent_step"] == 0
    assert step1["batch_size"] == config.buffer.train_batch_size
    assert step1["synced"] and step1["weights_version"] == 1
    assert metadata(instance, "experience_batch", "000001")["batch_size"] == 8
    assert metadata(instance, "synced_weights", "000001")["version"] == 1
    assert check_passed(one, "loss_is_finite") and check_passed(one, "kl_within_bound")
    groups = config.buffer.train_batch_size // config.algorithm.repeat_times
    assert step1["sample/task_count"] == groups  # one task per group in fill_buffer's rows
    preview = step1["rollout_examples"].splitlines()  # its lowest- and highest-reward rows
    assert preview[0] == "| step | prompt | response | reward |" and len(preview) == 4, preview

    # a restarted sensor asks for the steps left, from the newest trained one on
    run_config = resources["run_config"]
    restarted = trainer_request(instance, run_config)
    assert [r.run_key for r in restarted.run_requests] == ["train_job-000002-000004-0"]

    # one run over steps 2..4: one materialisation per step, each with its own metadata
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
    state = read_trainer_state(paths)
    assert state is not None and state.finished(4) and state.step == 4, state
    finished = trainer_request(instance, run_config)
    assert isinstance(finished, dg.SkipReason) and "training finished" in finished.skip_message

    # save_interval 2 and the final step; with sync_interval 1 and sync_method checkpoint
    # each save also serves as the sync: the checkpoint sensor records all three, runless
    recorded = checkpoint_records(instance, run_config)
    events = {(e.asset_key.to_user_string(), e.partition) for e in recorded.asset_events}
    assert events == {
        (asset, key)
        for asset in ("checkpoint", "hf_model", "synced_weights")
        for key in ("000002", "000004")
    }
    assert "000002" not in instance.get_materialized_partitions(dg.AssetKey("synced_weights"))

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
    stats = metadata_values(observation.asset_observation)
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


def test_a_sync_served_by_a_checkpoint_is_recorded_when_the_weights_marker_names_it(
    tmp_path: Path,
) -> None:
    # the trainer moves the weights marker just after the checkpoint is complete: a tick in
    # between records the checkpoint, and a later tick still records its sync
    config, config_file = tiny_config(tmp_path)
    run_config = RunConfigResource(config_path=str(config_file))
    paths = RunPaths.of_config(config)
    for step, serves in ((2, True), (3, False)):  # 3: an HF export that was not a sync
        ckpt = checkpoint_dir(paths, step)
        (ckpt / "huggingface").mkdir(parents=True)
        (ckpt / "huggingface" / "config.json").write_text("{}")
        manifest = build_manifest(
            ckpt, step=step, config_hash="h", sampler_state={}, serves_as_sync=serves
        )
        write_manifest(ckpt, manifest)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("step", ["000002", "000003"])

        def tick() -> set[tuple[str, str]]:
            result = checkpoint_records(instance, run_config)
            if isinstance(result, dg.SkipReason):
                return set()
            for event in result.asset_events:
                instance.report_runless_asset_event(event)
            return {(e.asset_key.to_user_string(), e.partition) for e in result.asset_events}

        complete = {
            (asset, key) for asset in ("checkpoint", "hf_model") for key in ("000002", "000003")
        }
        assert tick() == complete
        assert tick() == set()
        set_latest_weights_version(paths, 3)
        assert tick() == {("synced_weights", "000002")}
        assert tick() == set()


def test_without_total_steps_training_goes_on_until_the_explorers_data_ends(
    tmp_path: Path,
) -> None:
    # Trinity-RFT's default: no total_steps. One pass over the task set (buffer.total_epochs)
    # is all the data; every explore step may use the initial weights (sync_offset), so the
    # explorer run can finish before the trainer run starts, in process.
    config, config_file = tiny_config(
        tmp_path,
        {
            "trainer": {"total_steps": None, "save_interval": 0, "save_hf_checkpoint": "last"},
            "buffer": {"train_batch_size": 32, "total_epochs": 1},
            "synchronizer": {"sync_offset": 1000},
        },
    )
    run_config = RunConfigResource(config_path=str(config_file))
    resources = {"run_config": run_config, "engine": EngineResource(run_config=run_config)}
    paths = RunPaths.of(config.run_root)
    try:
        with dg.instance_for_test() as instance:
            context = dg.build_sensor_context(
                instance=instance, resources={"run_config": run_config}
            )
            first = build_rft_loop_sensor(config.dagster).evaluate_tick(context)
            requests = {request.job_name: request for request in first.run_requests}
            assert set(requests) == {"train_job", "rollouts_job"}
            for request in requests.values():  # open-ended runs from step 1, one partition
                assert request.tags[UNTIL_DATA_ENDS_TAG] == "true", request.tags
                assert (request.tags[RANGE_START], request.tags[RANGE_END]) == ("000001",) * 2
            (partitions,) = [
                r for r in first.dynamic_partitions_requests if r.partitions_def_name == "step"
            ]
            assert partitions.partition_keys == ["000001"]
            instance.add_dynamic_partitions("step", ["000001"])

            explored = dg.materialize(
                [rollouts],
                instance=instance,
                resources=resources,
                tags=requests["rollouts_job"].tags,
            )
            assert explored.success
            explore_steps = sorted(instance.get_materialized_partitions(dg.AssetKey("rollouts")))
            assert len(explore_steps) > 1, explore_steps  # partitions added as steps were done
            beat = seconds_since_beat(paths, BUILTIN_EXPLORER_ID)
            assert beat is not None and beat < 60, "the explorer loop beats as it goes"

            trained = dg.materialize(
                [train], instance=instance, resources=resources, tags=requests["train_job"].tags
            )
            assert trained.success
            steps = sorted(instance.get_materialized_partitions(dg.AssetKey("train_step")))
            assert steps == explore_steps, "one explore step of 32 rows per train step"
            # the step partitions are exactly the trained steps: 100% filled
            assert sorted(instance.get_dynamic_partitions("step")) == steps
            state = read_trainer_state(paths)
            assert state is not None and state.finished(None), state
            assert state.reason.startswith(DATA_ENDED) and state.step == len(steps), state
            final = checkpoint_dir(paths, len(steps))
            assert (final / "huggingface" / "config.json").is_file()
            after = trainer_request(instance, run_config)
            assert isinstance(after, dg.SkipReason) and "training finished" in after.skip_message
    finally:
        stop_service(paths)
