"""What keeps the sensor's work per launch bounded on a long run: trainer and explorer runs
over windows of `dagster.steps_per_run` steps, partitions added a window at a time, and a
Delta maintenance run every `dagster.maintenance_every_steps` steps."""

from pathlib import Path

import dagster as dg
import pytest

from assets.maintenance import delta_maintenance_job
from assets.sensors import (
    RANGE_END,
    RANGE_START,
    explorer_request,
    maintenance_request,
    trainer_request,
)
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.rules import explore_steps_needed
from trinity_dagster.graph_names import MAINTAINED_TAG
from trinity_dagster.step_keys import step_key
from trinity_dagster.testing import tiny_config


@pytest.fixture
def located(tmp_path: Path):
    _, config_file = tiny_config(
        tmp_path,
        {
            "trainer": {"total_steps": 10},
            "dagster": {"steps_per_run": 4, "maintenance_every_steps": 3},
        },
    )
    with dg.instance_for_test() as instance:
        yield instance, RunConfigResource(config_path=str(config_file))


def trained(instance: dg.DagsterInstance, asset: str, steps: range) -> None:
    """Record `asset[N]` for each of `steps`, as the runs do when a step is done."""
    instance.add_dynamic_partitions("step", [step_key(s) for s in steps])
    for step in steps:
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset, partition=step_key(step))
        )


def window(result: dg.SensorResult | dg.SkipReason) -> tuple[str, str, list[str]]:
    """The range of the one run asked for, and the partitions added with it."""
    assert isinstance(result, dg.SensorResult), result
    (request,) = result.run_requests
    (partitions,) = result.dynamic_partitions_requests
    return request.tags[RANGE_START], request.tags[RANGE_END], list(partitions.partition_keys)


def test_runs_cover_a_window_of_steps_and_add_only_its_partitions(located) -> None:
    instance, run_config = located
    assert window(trainer_request(instance, run_config)) == (
        "000001",
        "000004",
        ["000001", "000002", "000003", "000004"],
    )
    needed = explore_steps_needed(run_config.config)  # the tiny task set's explore steps
    assert needed is not None
    assert window(explorer_request(instance, run_config))[:2] == (
        "000001",
        step_key(min(4, needed)),
    )
    trained(instance, "train_step", range(1, 5))
    assert window(trainer_request(instance, run_config)) == (
        "000005",
        "000008",
        ["000005", "000006", "000007", "000008"],
    )
    trained(instance, "train_step", range(5, 9))
    start, end, keys = window(trainer_request(instance, run_config))
    assert (start, end, keys) == ("000009", "000010", ["000009", "000010"])  # total_steps 10


def test_delta_maintenance_is_launched_every_n_steps_while_training(located) -> None:
    instance, run_config = located
    skipped = maintenance_request(instance, run_config)
    assert isinstance(skipped, dg.SkipReason) and "after step 3" in skipped.skip_message
    trained(instance, "train_step", range(1, 4))
    asked = maintenance_request(instance, run_config)
    assert isinstance(asked, dg.SensorResult)
    (request,) = asked.run_requests
    assert request.job_name == delta_maintenance_job.name
    assert request.tags == {MAINTAINED_TAG: "3"}

    done = delta_maintenance_job.execute_in_process(
        instance=instance, resources={"run_config": run_config}, tags=request.tags
    )
    assert done.success
    again = maintenance_request(instance, run_config)
    assert isinstance(again, dg.SkipReason) and "after step 6" in again.skip_message
    trained(instance, "train_step", range(4, 7))
    later = maintenance_request(instance, run_config)
    assert isinstance(later, dg.SensorResult)
    assert later.run_requests[0].tags == {MAINTAINED_TAG: "6"}


def test_maintenance_every_steps_can_be_turned_off(tmp_path: Path) -> None:
    _, config_file = tiny_config(tmp_path, {"dagster": {"maintenance_every_steps": None}})
    with dg.instance_for_test() as instance:
        trained(instance, "train_step", range(1, 600))
        skipped = maintenance_request(instance, RunConfigResource(config_path=str(config_file)))
    assert isinstance(skipped, dg.SkipReason)
    assert "maintenance_every_steps is unset" in skipped.skip_message
