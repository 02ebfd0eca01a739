"""Every schedule of the code location, as the daemon runs it: the tick evaluated on a real
Dagster instance (on disk), the run it requests validated and executed through its job with
the run's resources, and the effect of that run checked on disk."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from assets.definitions import defs
from assets.partitions import step_key
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from tests.support.checkpoint import TinyProvider, damage_checksum_only
from trinity_dagster.buffer.maintenance import clean_logs
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.buffer.schema import EXPERIENCE_SCHEMA
from trinity_dagster.buffer.tables import TABLE_CONFIGURATION
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    scan_step_dirs,
    set_latest_checkpoint_step,
)
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.config import ConfigError, TrinityConfig, config_from_dict
from trinity_dagster.lineage.ledger import update_ledger
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import fill_buffer, pin_steps, tiny_config

TESTED = {"delta_maintenance", "checkpoint_retention", "evaluate_newest_checkpoint"}
TICK_TIME = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@dataclass
class Location:
    """The code location's definitions bound to one run, and a Dagster instance on disk."""

    definitions: dg.Definitions
    instance: dg.DagsterInstance
    run_config: RunConfigResource
    config: TrinityConfig
    paths: RunPaths

    def tick(self, name: str) -> dg.ScheduleExecutionData:
        """Evaluate one tick of schedule `name`, as the daemon would."""
        context = dg.build_schedule_context(
            instance=self.instance,
            scheduled_execution_time=TICK_TIME,
            resources={"run_config": self.run_config},
            repository_def=self.definitions.get_repository_def(),
        )
        return self.definitions.resolve_schedule_def(name).evaluate_tick(context)

    def run(self, name: str, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Execute the run `request` of schedule `name` through the schedule's job."""
        job = self.definitions.resolve_job_def(self.definitions.resolve_schedule_def(name).job_name)
        dg.validate_run_config(job, request.run_config)
        return job.execute_in_process(
            run_config=request.run_config,
            instance=self.instance,
            partition_key=request.partition_key,
            tags=request.tags,
        )

    def tick_and_run(self, name: str) -> dg.ExecuteInProcessResult:
        """One tick that requests exactly one run, and that run (which must succeed)."""
        requests = self.tick(name).run_requests
        assert requests is not None and len(requests) == 1, requests
        result = self.run(name, requests[0])
        assert result.success
        return result


@pytest.fixture
def located(tmp_path: Path) -> Iterator[Any]:
    """`located(extra)`: a Location for a tiny run configured with `extra`."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:

        def make(extra: dict[str, Any]) -> Location:
            config, file = tiny_config(tmp_path, extra)
            run_config = RunConfigResource(config_path=str(file))
            definitions = dg.Definitions(
                assets=defs.assets,
                asset_checks=defs.asset_checks,
                jobs=defs.jobs,
                sensors=defs.sensors,
                schedules=defs.schedules,
                resources={
                    "run_config": run_config,
                    "engine": EngineResource(run_config=run_config),
                },
            )
            return Location(definitions, instance, run_config, config, RunPaths.of(config.run_root))

        yield make


def test_every_schedule_of_the_code_location_is_tested_here() -> None:
    assert {schedule.name for schedule in defs.schedules} == TESTED


def _parquet_files(table_dir: str) -> set[str]:
    return {p.name for p in Path(table_dir).glob("*.parquet")}


def test_delta_maintenance_compacts_and_vacuums_with_the_runs_retention(located) -> None:
    location = located({"dagster": {"vacuum_retention_hours": 0}})
    config, paths = location.config, location.paths
    for seed in range(3):
        fill_buffer(config, steps=1, seed=seed)
    pin_steps(config, range(1, 3))
    experiences = DeltaTable(str(paths.experiences))
    before_rows = experiences.to_pyarrow_table().sort_by("eid")
    before_version = experiences.version()
    before_batches = {step: load_step_batch(config, step) for step in (1, 2)}
    assert len(_parquet_files(paths.experiences)) == 3

    location.tick_and_run("delta_maintenance")

    experiences = DeltaTable(str(paths.experiences))
    live = {Path(uri).name for uri in experiences.file_uris()}
    assert len(live) == 1  # compacted into one file ...
    assert _parquet_files(paths.experiences) == live  # ... and the three it replaced vacuumed
    new = experiences.history(experiences.version() - before_version)
    assert [entry["operation"] for entry in reversed(new)] == [
        "OPTIMIZE",
        "VACUUM START",
        "VACUUM END",
    ]
    assert experiences.to_pyarrow_table().sort_by("eid").equals(before_rows)
    batches = DeltaTable(str(paths.batches))
    assert _parquet_files(paths.batches) == {Path(uri).name for uri in batches.file_uris()}
    for step, batch in before_batches.items():
        assert load_step_batch(config, step).equals(batch)


def test_delta_maintenance_deletes_old_commit_files_once_the_ledger_has_read_them(
    located,
) -> None:
    location = located({})
    config, paths = location.config, location.paths
    steps = 12
    for seed in range(steps):
        fill_buffer(config, steps=1, seed=seed)
    pin_steps(config, range(1, steps + 1))
    before = {step: load_step_batch(config, step) for step in range(1, steps + 1)}
    an_hour_ago = datetime.now(UTC).timestamp() - 3600  # past the minute of log retention
    logs = [Path(table, "_delta_log") for table in (paths.experiences, paths.batches)]
    for log in logs:
        assert len(list(log.glob("*.json"))) == steps + 1  # the create, then one per commit
        for file in log.iterdir():
            os.utime(file, (an_hour_ago, an_hour_ago))

    location.tick_and_run("delta_maintenance")

    for log in logs:  # the commits before the newest checkpoint (one every 10) are gone
        names = sorted(p.name for p in log.glob("*.json"))
        assert len(names) <= 10 and f"{0:020d}.json" not in names, names
    ledger = DeltaTable(str(paths.ledger_steps)).to_pyarrow_table()
    assert sorted(set(ledger.column("step").to_pylist())) == list(range(1, steps + 1))
    assert ledger.column("batch_version").null_count == 0  # read before the clean-up
    for step, batch in before.items():
        assert load_step_batch(config, step).equals(batch)
    fill_buffer(config, steps=1, seed=steps)  # the tables go on from the checkpoint
    pin_steps(config, range(steps + 1, steps + 2))
    update_ledger(paths)  # and the ledger from the commits left
    ledger = DeltaTable(str(paths.ledger_steps)).to_pyarrow_table()
    newest = ledger.filter(pc.equal(ledger.column("step"), steps + 1))
    assert newest.num_rows > 0 and newest.column("batch_version").null_count == 0


def test_maintenance_gives_an_older_table_the_log_retention(tmp_path: Path) -> None:
    config, _ = tiny_config(tmp_path)
    paths = RunPaths.of_config(config)
    DeltaTable.create(str(paths.experiences), EXPERIENCE_SCHEMA)  # made before the setting
    clean_logs(config)
    configuration = DeltaTable(str(paths.experiences)).metadata().configuration
    assert {k: configuration.get(k) for k in TABLE_CONFIGURATION} == TABLE_CONFIGURATION


def test_vacuum_retention_must_be_whole_hours() -> None:
    with pytest.raises(ConfigError, match=r"dagster\.vacuum_retention_hours: .*fractional part"):
        config_from_dict({"dagster": {"vacuum_retention_hours": 1.5}})
    assert config_from_dict({"dagster": {"vacuum_retention_hours": 24.0}}).dagster == (
        config_from_dict({"dagster": {"vacuum_retention_hours": 24}}).dagster
    )


def test_checkpoint_retention_keeps_the_newest_good_checkpoint(located) -> None:
    location = located({"trainer": {"max_checkpoints_to_keep": 1}})
    paths = location.paths
    keep_all = config_from_dict(
        {"run_root": str(paths.root), "trainer": {"max_checkpoints_to_keep": None}}
    )
    provider = TinyProvider()
    manager = CheckpointManager(keep_all, paths, provider)
    for step in (1, 2, 3):
        provider.train()
        manager.save(step, block=True)
    damage_checksum_only(checkpoint_dir(paths, 3))  # the newest is damaged: step 2 is the good one

    location.tick_and_run("checkpoint_retention")

    assert [(d.step, d.kind) for d in scan_step_dirs(paths.checkpoints)] == [
        (2, "final"),
        (3, "final"),
    ]


def test_evaluate_newest_checkpoint_scores_it_under_one_run_key(located) -> None:
    location = located({"explorer": {"eval_tasks": 4}})
    paths = location.paths
    skipped = location.tick("evaluate_newest_checkpoint")
    assert not skipped.run_requests
    assert skipped.skip_message == "no complete checkpoint yet"

    initial = create_initial_model(location.config, paths)
    shutil.copytree(initial, checkpoint_dir(paths, 2) / HF_SUBDIR)  # its HF export
    set_latest_checkpoint_step(paths, 2)
    key = step_key(2)
    location.instance.add_dynamic_partitions("step", [key])
    requests = location.tick("evaluate_newest_checkpoint").run_requests
    assert [(r.run_key, r.partition_key) for r in requests] == [(f"eval-{key}", key)]

    location.tick_and_run("evaluate_newest_checkpoint")

    record = location.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("evaluation"), asset_partitions=[key]),
        limit=1,
    ).records[0]
    metadata = record.asset_materialization.metadata
    assert metadata["weights_version"].value == 2
    assert 0.0 <= metadata["eval/addition_eval/accuracy"].value <= 1.0
