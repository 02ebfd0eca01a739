"""Dagster's PostgreSQL run and event storages with one connection kept open per process.

`dagster-postgres` opens a new database connection for every read and write (SQLAlchemy's
`NullPool`), so that no instance holds connections it does not use. A training run's
processes (the daemon, the trainer and explorer run workers, the webserver) each write or
read many times a second; connecting each time cost a step's events 58 ms instead of 12 ms
on SQLite (`bench scale`, 200 steps). These subclasses keep one pooled connection per process,
checked before use (`pool_pre_ping`) and renewed hourly; everything else, tables included,
is Dagster's, so an instance can switch between them and the plain classes.

Configured in the instance's `dagster.yaml` (`trinity_dagster.dagster_instance`) when
`dagster.postgres_url` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster._serdes import ConfigurableClassData
from dagster_postgres.event_log.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage.run_storage import PostgresRunStorage
from dagster_postgres.utils import create_pg_engine, pg_url_from_config
from sqlalchemy.engine import Engine

POOL = {"pool_size": 1, "max_overflow": 4, "pool_recycle": 3600, "pool_pre_ping": True}


def pooled_engine(postgres_url: str) -> Engine:
    """An engine for `postgres_url` that keeps its connection between calls."""
    return create_pg_engine(postgres_url, None, isolation_level="AUTOCOMMIT", **POOL)


class PooledConnection:
    """Mixed in before a dagster-postgres storage: its engine keeps one connection."""

    postgres_url: str
    _engine: Engine

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
    ) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data)  # type: ignore[call-arg]
        self._engine.dispose()
        self._engine = pooled_engine(self.postgres_url)

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> Any:
        """The storage the instance's `dagster.yaml` configures."""
        return cls(
            pg_url_from_config(config_value),
            config_value.get("should_autocreate_tables", True),
            inst_data,
        )


class PooledPostgresEventLogStorage(PooledConnection, PostgresEventLogStorage):
    """`PostgresEventLogStorage` that reuses its connection."""


class PooledPostgresRunStorage(PooledConnection, PostgresRunStorage):
    """`PostgresRunStorage` that reuses its connection."""
