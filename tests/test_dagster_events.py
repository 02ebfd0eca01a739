"""The pooled SQLite event storage: Dagster's files and schema, a bounded set of open ones."""

import sqlite3
from pathlib import Path

import dagster as dg
import psutil
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from sqlalchemy import text

from trinity_dagster.dagster_events import MAX_OPEN_DATABASES, PooledSqliteEventLogStorage
from trinity_dagster.dagster_instance import write_instance_yaml


def open_databases(directory: Path) -> set[str]:
    """The SQLite files under `directory` this process holds open."""
    return {
        f.path
        for f in psutil.Process().open_files()
        if f.path.startswith(str(directory)) and f.path.endswith(".db")
    }


def test_events_land_where_dagsters_own_storage_reads_them(tmp_path: Path) -> None:
    write_instance_yaml(tmp_path)
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.event_log_storage, PooledSqliteEventLogStorage)
        for step in range(3):
            event = dg.AssetMaterialization("train_step", partition=str(step), metadata={"s": step})
            instance.report_runless_asset_event(event)
    stock = SqliteEventLogStorage(str(tmp_path / "history" / "runs"))
    records = stock.fetch_materializations(dg.AssetKey("train_step"), limit=10).records
    partitions = [r.asset_materialization.partition for r in records if r.asset_materialization]
    assert sorted(partitions) == ["0", "1", "2"]


def test_only_the_most_recently_used_databases_stay_open(tmp_path: Path) -> None:
    storage = PooledSqliteEventLogStorage(str(tmp_path))
    runs = [f"run{k}" for k in range(MAX_OPEN_DATABASES + 3)]
    for run in runs:
        with storage.run_connection(run) as conn:
            conn.execute(text("select 1"))
    still_open = open_databases(tmp_path)
    assert str(tmp_path / f"{runs[-1]}.db") in still_open  # kept for the next event
    assert str(tmp_path / f"{runs[0]}.db") not in still_open  # evicted
    assert len(still_open) <= MAX_OPEN_DATABASES
    storage.dispose()
    assert not open_databases(tmp_path)


def test_a_table_found_once_is_not_looked_up_again(tmp_path: Path, monkeypatch) -> None:
    storage = PooledSqliteEventLogStorage(str(tmp_path))
    assert storage.supports_asset_checks  # the index database has the checks' table
    looked_up: list[str] = []

    def counting(self: SqliteEventLogStorage, table_name: str) -> bool:
        looked_up.append(table_name)
        return False

    monkeypatch.setattr(SqliteEventLogStorage, "has_table", counting)
    assert storage.supports_asset_checks
    assert not storage.has_table("no_such_table")
    assert not storage.has_table("no_such_table")  # a missing table may come with a migration
    assert looked_up == ["no_such_table", "no_such_table"]
    storage.dispose()


def test_the_asset_key_index_columns_are_read_once(tmp_path: Path, monkeypatch) -> None:
    write_instance_yaml(tmp_path)
    reads: list[bool] = []
    original = SqliteEventLogStorage._has_asset_key_index_cols_on_connection

    def counting(self: SqliteEventLogStorage, conn) -> bool:
        reads.append(original(self, conn))
        return reads[-1]

    monkeypatch.setattr(SqliteEventLogStorage, "_has_asset_key_index_cols_on_connection", counting)
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        for step in range(3):
            event = dg.AssetMaterialization("train_step", partition=str(step))
            instance.report_runless_asset_event(event)
        assert reads == [True]  # the first materialisation read them; the others did not
        status = instance.get_asset_records([dg.AssetKey("train_step")])[0].asset_entry
        assert status.last_materialization_record is not None
        assert status.last_materialization_record.asset_materialization.partition == "2"


def synchronous_setting(storage: PooledSqliteEventLogStorage, run_id: str | None) -> int:
    """SQLite's `synchronous` on the storage's connection to a run's database (None: the
    index database): 1 is NORMAL, 2 FULL."""
    connection = storage.index_connection() if run_id is None else storage.run_connection(run_id)
    with connection as conn:
        return conn.execute(text("PRAGMA synchronous")).scalar_one()


def test_commits_skip_the_fsync_only_in_write_ahead_log_mode(tmp_path: Path) -> None:
    storage = PooledSqliteEventLogStorage(str(tmp_path))
    assert synchronous_setting(storage, "new_run") == 1  # created by Dagster, in WAL mode
    assert synchronous_setting(storage, None) == 1
    storage.dispose()
    reopened = PooledSqliteEventLogStorage(str(tmp_path))
    assert synchronous_setting(reopened, "new_run") == 1
    reopened.dispose()

    with sqlite3.connect(tmp_path / "old_journal.db") as plain:  # a rollback-journal database
        plain.execute("create table t (x)")
    plain.close()
    other = PooledSqliteEventLogStorage(str(tmp_path))
    engine = other._engine("old_journal")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 2  # SQLite's default
    other.dispose()
