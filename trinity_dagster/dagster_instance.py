"""The Dagster instance settings a trinity-dagster run needs (`DAGSTER_HOME/dagster.yaml`).

`trinity-dagster run`/`demo` write them under the run root; `dagster dev` users copy them
into their own `DAGSTER_HOME` (the README shows how). Why each setting:
- the queued run coordinator dequeues every second, so a run starts about a second after
  the sensor asks for it;
- run monitoring frees the concurrency slots of a run whose worker was killed, so the
  engine pool (limit 1) never stays claimed by a dead run;
- run retries restart a run whose worker crashed (not one whose step failed: an error in
  the loop fails the run and stays visible); the loops resume from what is on disk;
- pools default to a limit of 1: every op that drives the engine is in the `engine` pool;
- storage: with `dagster.postgres_url` set, Dagster's PostgreSQL storages (runs, events,
  schedules) in that database, the run and event storages keeping a connection open
  (`trinity_dagster.dagster_postgres_pool`); otherwise SQLite files in `DAGSTER_HOME`, events
  through `trinity_dagster.dagster_events.PooledSqliteEventLogStorage`, Dagster's SQLite
  event storage keeping each database's connection open between events (a fifth of the cost
  per event), in the same files as the default storage.
No dagster import here.
"""

from __future__ import annotations

import json
from pathlib import Path

WILL_RETRY_TAG = "dagster/will_retry"  # run retries' decision on a failed run: "true"/"false"

SQLITE_STORAGE = """\
# Dagster instance of a trinity-dagster run (SQLite storage in this directory).
event_log_storage:
  module: trinity_dagster.dagster_events
  class: PooledSqliteEventLogStorage
  config:
    base_dir: {dagster_home}/history/runs/
"""
POSTGRES_STORAGE = """\
# Dagster instance of a trinity-dagster run (runs, events and schedules in PostgreSQL).
run_storage:
  module: trinity_dagster.dagster_postgres_pool
  class: PooledPostgresRunStorage
  config:
    postgres_url: {postgres_url}
event_log_storage:
  module: trinity_dagster.dagster_postgres_pool
  class: PooledPostgresEventLogStorage
  config:
    postgres_url: {postgres_url}
schedule_storage:
  module: dagster_postgres.schedule_storage
  class: PostgresScheduleStorage
  config:
    postgres_url: {postgres_url}
"""
INSTANCE_YAML = """\
telemetry:
  enabled: false
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  free_slots_after_run_end_seconds: 5
run_retries:
  enabled: true
  max_retries: 3
  retry_on_asset_or_op_failure: false
concurrency:
  pools:
    default_limit: 1
"""


def with_driver(postgres_url: str) -> str:
    """`postgres_url` naming psycopg2, the driver dagster-postgres installs, if it names none
    (SQLAlchemy 2.1 would otherwise pick psycopg 3)."""
    scheme, sep, rest = postgres_url.partition("://")
    return f"postgresql+psycopg2://{rest}" if scheme == "postgresql" and sep else postgres_url


def instance_yaml(dagster_home: Path, postgres_url: str | None = None) -> str:
    """The instance settings for the instance in `dagster_home`, its storage in PostgreSQL
    database `postgres_url` if given (else SQLite files in `dagster_home`)."""
    if postgres_url is None:
        storage = SQLITE_STORAGE.format(dagster_home=dagster_home.resolve())
    else:
        storage = POSTGRES_STORAGE.format(postgres_url=json.dumps(with_driver(postgres_url)))
    return storage + INSTANCE_YAML


def write_instance_yaml(
    dagster_home: Path, postgres_url: str | None = None, *, replace: bool = False
) -> Path:
    """Write the instance settings into `dagster_home`; a `dagster.yaml` already there is kept
    unless `replace`."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    if replace or not path.exists():
        path.write_text(instance_yaml(dagster_home, postgres_url))
    return path
