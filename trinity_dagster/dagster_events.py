"""Dagster's SQLite event storage with one engine per database kept open between events.

`SqliteEventLogStorage` builds a SQLAlchemy engine and opens a connection for every read and
write, then disposes of both. A loop step logs four materialisations, and each one writes the
run's database and the index database: building and opening took about 5 of an event's 8 ms
(in process, 300 events). This subclass keeps each database's engine, and so its pooled
connection, for the next call. Everything else, files and schema included, is Dagster's, so
an instance can switch between the two classes. Engines of the `MAX_OPEN_DATABASES` most
recently used databases stay open (a webserver reads many runs' databases); the others are
disposed of. A table or column of the index database, once found, is not looked up again:
the base class opens an engine of its own to look a table up, and reads the asset-key table's
columns, for each asset event.

Commits skip the fsync on databases in write-ahead-log mode, which Dagster puts every event
database in (SQLite's `synchronous=NORMAL`, the setting SQLite recommends for that mode). A
killed process loses no committed event, since the log is in the operating system's cache;
an operating-system crash or power cut may lose the last events but never corrupts the
database. An event cost the committing process about 1 ms more with the fsync, and up to 5 ms
more of wall time.

Configured in the instance's `dagster.yaml` (`trinity_dagster.dagster_instance`):

    event_log_storage:
      module: trinity_dagster.dagster_events
      class: PooledSqliteEventLogStorage
      config:
        base_dir: <DAGSTER_HOME>/history/runs/
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._serdes import ConfigurableClassData
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine

MAX_OPEN_DATABASES = 8


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """`SqliteEventLogStorage` that reuses each database's engine and connection."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self._tables_found: set[str] = set()
        self._index_columns_found = False
        super().__init__(base_dir, inst_data)

    def has_table(self, table_name: str) -> bool:
        """Whether the index database has `table_name`; a table once found is not looked up
        again (the base class opens an engine and reads the schema on every asset event)."""
        if table_name in self._tables_found:
            return True
        found = super().has_table(table_name)
        if found:
            self._tables_found.add(table_name)
        return found

    def _has_asset_key_index_cols_on_connection(self, conn: Connection) -> bool:
        """Whether the asset-key table has its index columns; once found, not read again (the
        base class reads the table's columns for every materialisation)."""
        if not self._index_columns_found:
            self._index_columns_found = super()._has_asset_key_index_cols_on_connection(conn)
        return self._index_columns_found

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Any
    ) -> PooledSqliteEventLogStorage:
        """The storage the instance's `dagster.yaml` configures."""
        return cls(inst_data=inst_data, **config_value)

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        with self._db_lock:  # one connection at a time, as in the base class
            engine = self._engine(shard)
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
                engine.dispose()  # the next connection sees the journal mode `_initdb` set
            with engine.connect() as conn, conn.begin():
                yield conn

    def _engine(self, shard: str) -> Engine:
        """The engine of database `shard`, created on first use; evicts the least recent."""
        engine = self._engines.pop(shard, None)
        if engine is None:
            engine = create_engine(
                self.conn_string_for_shard(shard),
                pool_size=1,
                connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS},
            )
            event.listen(engine, "connect", commit_without_fsync_in_wal_mode)
        self._engines[shard] = engine
        while len(self._engines) > MAX_OPEN_DATABASES:
            _, evicted = self._engines.popitem(last=False)
            evicted.dispose()
        return engine

    def dispose(self) -> None:
        """Close every kept engine, then let the base class clean up."""
        with self._db_lock:
            while self._engines:
                self._engines.popitem()[1].dispose()
        super().dispose()


def commit_without_fsync_in_wal_mode(dbapi_connection: Any, _record: Any) -> None:
    """Set `synchronous=NORMAL` on a new connection to a database in write-ahead-log mode
    (commits no longer wait for an fsync); other databases keep SQLite's default."""
    cursor = dbapi_connection.cursor()
    try:
        (mode,) = cursor.execute("PRAGMA journal_mode").fetchone()
        if mode == "wal":
            cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()
