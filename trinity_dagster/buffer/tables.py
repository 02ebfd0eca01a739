"""Opening and creating the buffer's Delta tables, and the conflict-retry loop for commits.

A table is named by its location: a local path or a `file://` URI (see `trinity_dagster.paths`).
Delta Lake (deltalake 1.6) resolves the location to its real absolute path and mishandles some
characters in it, so a location whose path has them is refused before Delta Lake sees it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import DeltaTable, WriterProperties
from deltalake.exceptions import (
    CommitFailedError,
    DeltaError,
    DeltaProtocolError,
    TableNotFoundError,
)

from trinity_dagster.buffer.schema import ROW_GROUP_ROWS
from trinity_dagster.paths import delta_unaddressable, local_path

T = TypeVar("T")

# Opening a table replays the log commits since its last checkpoint; a commit per step would
# make every open slower until Delta's default checkpoint at 100 commits (measured: 1.5 ms
# at 5 commits, 12 ms at 50). A checkpoint every 10 commits keeps an open at about 3 ms.
# Every open and commit also lists `_delta_log`, so they slow down as the log grows (a 256-row
# append: 11 ms at 100 commits, 65 ms at 6,000). `maintenance.clean_logs` deletes commit
# files older than the retention below once the lineage ledger has read them; Delta's own
# clean-up at each checkpoint is off, as it would not wait for the ledger. The retention only
# has to outlast a maintenance run (the ledger update before the clean-up) and a reader's
# listing of the log: a minute. Nothing here reads an old version of a table.
TABLE_CONFIGURATION = {
    "delta.checkpointInterval": "10",
    "delta.logRetentionDuration": "interval 1 minute",
    "delta.enableExpiredLogCleanup": "false",
}


class CommitRetriesExhaustedError(RuntimeError):
    """A commit kept conflicting with concurrent commits after all allowed retries."""


def writer_properties() -> WriterProperties:
    """Parquet settings for every buffer write: small row groups for row-group pruning."""
    return WriterProperties(max_row_group_size=ROW_GROUP_ROWS, compression="SNAPPY")


def addressable(location: str | Path) -> str:
    """`location` as text for Delta Lake.

    Raises ValueError if its real path has characters Delta Lake mishandles
    (`paths.delta_unaddressable`).
    """
    found = delta_unaddressable(location)
    if found:
        real = local_path(location).resolve()
        raise ValueError(
            f"Delta table location {str(location)!r} (real path {str(real)!r}) contains "
            f"{', '.join(repr(c) for c in found)}, which Delta Lake cannot address "
            "(^ | [ ] \\, control characters, % and two hex digits): choose a run_root or "
            "buffer.tables_root without them"
        )
    return str(location)


def open_table(location: str | Path) -> DeltaTable | None:
    """The Delta table at `location` at its latest version, or None if there is none yet.

    Raises ValueError for a location Delta Lake cannot address (see `addressable`).
    """
    try:
        return DeltaTable(addressable(location))
    except TableNotFoundError:
        return None


def _commit_file(location: str | Path, version: int) -> Path:
    """Where commit `version` of the Delta table at `location` lands: in one atomic step, as
    `_delta_log/<version, 20 digits>.json`, one JSON action per line."""
    return local_path(location) / "_delta_log" / f"{version:020d}.json"


def has_commit_after(location: str | Path, version: int | None) -> bool:
    """Whether the Delta table at `location` has a commit newer than `version` (None: any).

    A waiting reader can tell from one or two `stat`s whether reading the table again can find
    anything new. The log clean-up (`maintenance.clean_logs`) deletes commit files that a log
    checkpoint covers, so a reader whose own commit file is gone asks the checkpoint instead.
    """
    after = -1 if version is None else version
    if _commit_file(location, after + 1).exists():
        return True
    if after >= 0 and _commit_file(location, after).exists():
        return False
    return _checkpoint_version(location) > after


def _checkpoint_version(location: str | Path) -> int:
    """The version of the Delta table's latest log checkpoint (-1: none)."""
    try:
        pointer = local_path(location) / "_delta_log" / "_last_checkpoint"
        return int(json.loads(pointer.read_text(encoding="utf-8"))["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


@dataclass(frozen=True)
class Commit:
    """One commit of a Delta table as its log records it: its `commitInfo` (custom metadata
    included) and the `add` actions of the data files it added."""

    info: dict[str, Any]
    added: list[dict[str, Any]]

    @property
    def added_paths(self) -> list[str]:
        """The added files' paths relative to the table root (the log percent-encodes them)."""
        return [unquote(add["path"]) for add in self.added]


def read_commit(location: str | Path, version: int) -> Commit | None:
    """Commit `version` of the Delta table at `location`, or None when its file is gone (log
    clean-up) or was never written."""
    try:
        text = _commit_file(location, version).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    # one action a line, split at "\n" only: values may hold other line breaks (U+0085, U+2028)
    actions = [json.loads(line) for line in text.split("\n") if line.strip()]
    info: dict[str, Any] = next(
        (action["commitInfo"] for action in actions if "commitInfo" in action), {}
    )
    return Commit(info, [action["add"] for action in actions if "add" in action])


def open_or_create(location: str | Path, schema: pa.Schema) -> DeltaTable:
    """The Delta table at `location`, created empty with `schema` if absent (safe under races).

    A new table gets `TABLE_CONFIGURATION`. Raises ValueError for a location Delta Lake cannot
    address (see `addressable`).
    """
    table = open_table(location)
    if table is not None:
        return table
    local_path(location).parent.mkdir(parents=True, exist_ok=True)
    try:
        return DeltaTable.create(
            str(location), schema, mode="error", configuration=TABLE_CONFIGURATION
        )
    except (DeltaError, CommitFailedError):
        # Another process created it between the check and the create.
        table = open_table(location)
        if table is None:
            raise
        return table


# commits a held table follows incrementally before it is opened afresh (see `HeldTable`)
HELD_TABLE_COMMITS = int(TABLE_CONFIGURATION["delta.checkpointInterval"])


class HeldTable:
    """One Delta table kept open between uses, brought up to date at each use.

    A handle of deltalake 1.6 replays every commit since the log checkpoint it was opened at,
    on each update and again in each write and scan, so an aging handle slows down (a pin took
    15 ms at first and 57 ms 400 commits later). Reopened once it has followed
    `HELD_TABLE_COMMITS` commits, it costs an open at most once per log checkpoint. A use with
    no newer commit (`has_commit_after`: one `stat`) skips the update, which lists the log
    (1-1.5 ms here; more as the log grows).
    """

    def __init__(self, location: str | Path, create_with: pa.Schema | None = None) -> None:
        self.location = location
        self._schema = create_with
        self._table: DeltaTable | None = None
        self._opened_at = 0

    def get(self) -> DeltaTable | None:
        """The table at its latest version (None if it does not exist and is not created)."""
        if self._table is not None:
            if has_commit_after(self.location, self._table.version()):
                self._table.update_incremental()
            if self._table.version() - self._opened_at < HELD_TABLE_COMMITS:
                return self._table
        if self._schema is None:
            self._table = open_table(self.location)
        else:
            self._table = open_or_create(self.location, self._schema)
        if self._table is not None:
            self._opened_at = self._table.version()
        return self._table


def add_actions(table: DeltaTable) -> pa.Table:
    """The live data files of `table` with their row counts and column statistics."""
    return pa.table(table.get_add_actions(flatten=True))


class DataFiles:
    """Opens data files of one Delta table (paths as in its log) as parquet fragments."""

    def __init__(self, table: DeltaTable) -> None:
        self.filesystem, base = pafs.FileSystem.from_uri(table.table_uri)
        self._base = base.rstrip("/")
        self.format = ds.ParquetFileFormat()

    def open(self, path: str) -> ds.FileFragment:
        """The parquet fragment of the data file at `path` (relative to the table root)."""
        return self.format.make_fragment(f"{self._base}/{path}", filesystem=self.filesystem)


# reader features under which a data file alone does not give the table's rows
UNREADABLE_FEATURES = {"deletionVectors", "columnMapping"}


def table_dataset(
    table: DeltaTable, column: str | None = None, low: int | None = None, high: int | None = None
) -> ds.Dataset:
    """The snapshot's live data files as a dataset on Arrow's own file system, without the
    files whose `column` statistics rule out every value in `low..high` (None: unbounded; a
    file without statistics is kept). Row filters are the caller's.

    Used instead of `DeltaTable.to_pyarrow_dataset`, whose Python file system, called from
    Arrow's IO threads, now and then aborts the process at exit ("terminate called without
    an active exception": 4 of 100 runs of `trinity-dagster lineage`, none of 100 with this).
    Raises `DeltaProtocolError` for a table whose rows the plain files do not give as they
    are (deletion vectors, column mapping), as that method does.
    """
    unreadable = set(table.protocol().reader_features or ()) & UNREADABLE_FEATURES
    if unreadable:
        raise DeltaProtocolError(
            f"Delta table {table.table_uri} uses reader features {sorted(unreadable)}, "
            "which this project does not read (it writes tables without them)"
        )
    actions = add_actions(table)
    if actions.num_rows and column is not None and f"min.{column}" in actions.column_names:
        admits = pa.array([True] * actions.num_rows)
        if low is not None:
            admits = pc.and_kleene(admits, pc.greater_equal(actions.column(f"max.{column}"), low))
        if high is not None:
            admits = pc.and_kleene(admits, pc.less_equal(actions.column(f"min.{column}"), high))
        actions = actions.filter(pc.fill_null(admits, True))
    files = DataFiles(table)
    paths = actions.column("path").to_pylist() if actions.num_rows else []
    schema = pa.schema(table.schema().to_arrow())
    return ds.FileSystemDataset(
        [files.open(path) for path in paths], schema, files.format, files.filesystem
    )


def retry_commits(attempt: Callable[[], T], max_retries: int, what: str) -> T:
    """Run `attempt` until it commits; retry on CommitFailedError with jittered backoff."""
    delay = 0.01
    for tries in range(max_retries + 1):
        try:
            return attempt()
        except CommitFailedError as err:
            if tries == max_retries:
                raise CommitRetriesExhaustedError(
                    f"{what}: commit still conflicting after {max_retries} retries "
                    f"(buffer.writer_max_retries): {err}"
                ) from err
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")
