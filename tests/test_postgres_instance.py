"""The Dagster instance in PostgreSQL: `trinity-dagster run` with `dagster.postgres_url` set,
on a throwaway local server, trains through the real daemon; the instance settings it writes
name the Postgres storage."""

import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster_postgres.run_storage.run_storage import PostgresRunStorage

from assets.sensors import RANGE_END, RANGE_START
from trinity_dagster.config import ConfigError
from trinity_dagster.dagster_instance import instance_yaml
from trinity_dagster.dagster_postgres_pool import PooledPostgresEventLogStorage
from trinity_dagster.local_postgres import local_postgres
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key
from trinity_dagster.testing import tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_instance_settings_name_the_postgres_database(tmp_path: Path) -> None:
    settings = yaml.safe_load(instance_yaml(tmp_path, "postgresql://me@db:5432/rft"))
    for storage in ("run_storage", "event_log_storage", "schedule_storage"):
        url = settings[storage]["config"]["postgres_url"]
        assert url == "postgresql+psycopg2://me@db:5432/rft"  # the driver dagster-postgres brings
    assert settings["run_coordinator"]["config"]["dequeue_interval_seconds"] == 1
    sqlite = yaml.safe_load(instance_yaml(tmp_path))
    assert sqlite["event_log_storage"]["class"] == "PooledSqliteEventLogStorage"


def test_a_postgres_url_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dagster\.postgres_url"):
        tiny_config(tmp_path, {"dagster": {"postgres_url": "mysql://db/rft"}})


@pytest.mark.slow
def test_a_run_on_a_postgres_instance_trains_in_windows_and_maintains_its_tables(
    tmp_path: Path,
) -> None:
    with local_postgres() as server:
        url = server.create_database("run")
        config, config_file = tiny_config(
            tmp_path,
            {"dagster": {"postgres_url": url, "steps_per_run": 3, "maintenance_every_steps": 2}},
        )
        total = config.trainer.total_steps
        assert total == 6
        done = subprocess.run(
            [str(Path(sys.executable).parent / "trinity-dagster"), "run", "-c", str(config_file)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        paths = RunPaths.of_config(config)
        assert not (paths.dagster_home / "history").exists()  # no SQLite storage
        with dg.DagsterInstance.from_config(str(paths.dagster_home)) as instance:
            assert isinstance(instance.run_storage, PostgresRunStorage)
            assert isinstance(instance.event_log_storage, PooledPostgresEventLogStorage)
            trained = instance.get_materialized_partitions(dg.AssetKey("train_step"))
            assert trained == {step_key(s) for s in range(1, total + 1)}
            runs = instance.get_runs(
                filters=dg.RunsFilter(job_name="train_job", statuses=[dg.DagsterRunStatus.SUCCESS])
            )
            ranges = sorted((r.tags[RANGE_START], r.tags[RANGE_END]) for r in runs)
            assert ranges == [("000001", "000003"), ("000004", "000006")]
            maintained = instance.get_runs(
                filters=dg.RunsFilter(
                    job_name="delta_maintenance_job", statuses=[dg.DagsterRunStatus.SUCCESS]
                )
            )
            assert maintained, "the sensor launched no Delta maintenance while training"
