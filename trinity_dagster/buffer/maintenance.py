"""Delta maintenance of the buffer and ledger tables: compaction, vacuum and log clean-up,
safe for pinned steps.

Replay of a pinned step reads only the current version of `batches`, which neither
compaction (a data-preserving rewrite) nor vacuum (removes only files no longer referenced)
changes, so both are safe at any time. Log clean-up deletes the commit files of versions
older than the table's log retention (`tables.TABLE_CONFIGURATION`) that a checkpoint
covers: nothing here reads an old version, but the lineage ledger reads the commit metadata
of `batches` and `experiences`, so clean the logs only right after `update_ledger`.
"""

from __future__ import annotations

from typing import Any

from trinity_dagster.buffer.tables import TABLE_CONFIGURATION, open_table, writer_properties
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths, local_path


def _tables(config: TrinityConfig) -> dict[str, Any]:
    paths = RunPaths.of_config(config)
    found = {
        name: open_table(path)
        for name, path in (
            ("experiences", paths.experiences),
            ("batches", paths.batches),
            ("quarantine", paths.quarantine),
            ("ledger/steps", paths.ledger_steps),
            ("ledger/rollouts", paths.ledger_rollouts),
        )
    }
    return {name: table for name, table in found.items() if table is not None}


def compact(config: TrinityConfig) -> dict[str, dict[str, int]]:
    """Optimize (bin-pack) every buffer table; files added/removed per table."""
    out = {}
    for name, table in _tables(config).items():
        metrics = table.optimize.compact(writer_properties=writer_properties())
        out[name] = {
            "files_added": int(metrics.get("numFilesAdded", 0)),
            "files_removed": int(metrics.get("numFilesRemoved", 0)),
        }
    return out


def vacuum(
    config: TrinityConfig, retention_hours: int, enforce_retention_duration: bool = True
) -> dict[str, int]:
    """Delete unreferenced files older than `retention_hours` (whole hours); deletions per table.

    `enforce_retention_duration` refuses a retention below the table's own minimum (168 hours).
    """
    if isinstance(retention_hours, bool) or not isinstance(retention_hours, int):
        raise TypeError(
            f"vacuum: retention_hours must be whole hours (an int), got {retention_hours!r}"
        )
    if retention_hours < 0:
        raise ValueError(f"vacuum: retention_hours must be >= 0, got {retention_hours}")
    return {
        name: len(
            table.vacuum(
                retention_hours=retention_hours,
                dry_run=False,
                enforce_retention_duration=enforce_retention_duration,
            )
        )
        for name, table in _tables(config).items()
    }


def clean_logs(config: TrinityConfig) -> dict[str, int]:
    """Delete expired commit files of every buffer table; log files left per table.

    A table made before its log retention was part of `TABLE_CONFIGURATION` gets it first (a
    commit of table properties), so its log stops growing from then on.
    """
    left = {}
    for name, table in _tables(config).items():
        configuration = table.metadata().configuration
        missing = {k: v for k, v in TABLE_CONFIGURATION.items() if configuration.get(k) != v}
        if missing:
            table.alter.set_table_properties(missing, raise_if_not_exists=False)
        table.cleanup_metadata()
        left[name] = sum(1 for _ in local_path(table.table_uri).joinpath("_delta_log").iterdir())
    return left
