"""The buffer's Delta tables stay cheap to open however many steps have committed, and read
as Delta Lake reads them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import DeltaProtocolError

from trinity_dagster.buffer.tables import (
    HeldTable,
    has_commit_after,
    open_or_create,
    read_commit,
    table_dataset,
)


def test_new_tables_checkpoint_their_log_every_ten_commits(tmp_path: Path) -> None:
    path = tmp_path / "table"
    rows = pa.table({"step": pa.array([1], pa.int64())})
    open_or_create(path, rows.schema)
    for _ in range(25):
        write_deltalake(str(path), rows, mode="append")
    last_checkpoint = json.loads((path / "_delta_log" / "_last_checkpoint").read_text())
    table = DeltaTable(str(path))
    assert table.version() == 25  # version 0 is the create, 1..25 the appends
    assert table.version() - last_checkpoint["version"] <= 10  # at most 10 commits to replay
    assert table.to_pyarrow_table().num_rows == 25


def test_a_held_table_follows_commits_whose_files_the_log_clean_up_deleted(
    tmp_path: Path,
) -> None:
    """A reader idle past the log retention sees the commits made meanwhile, though the
    clean-up deleted the commit files right after the version it holds."""
    path = tmp_path / "table"
    rows = pa.table({"step": pa.array([1], pa.int64())})
    open_or_create(path, rows.schema)
    held = HeldTable(path)
    assert held.get().version() == 0
    for _ in range(25):
        write_deltalake(str(path), rows, mode="append")
    log = path / "_delta_log"
    an_hour_ago = time.time() - 3600  # past the tables' log retention
    for file in log.iterdir():
        os.utime(file, (an_hour_ago, an_hour_ago))
    DeltaTable(str(path)).cleanup_metadata()  # what maintenance's clean_logs does
    assert not (log / f"{1:020d}.json").exists()
    assert has_commit_after(path, 0) and has_commit_after(path, None)
    assert not has_commit_after(path, 25)
    table = held.get()
    assert table.version() == 25 and table.to_pyarrow_table().num_rows == 25


def test_a_table_dataset_reads_what_delta_lake_reads_skipping_files_by_statistics(
    tmp_path: Path,
) -> None:
    path = tmp_path / "table"
    table = open_or_create(path, pa.schema([("step", pa.int64()), ("eid", pa.string())]))
    for step in range(1, 7):
        rows = pa.table({"step": [step, step], "eid": [f"{step}-a", f"{step}-b"]})
        write_deltalake(table, rows, mode="append")
    write_deltalake(table, pa.table({"step": [2, 5], "eid": ["late-2", "late-5"]}), mode="append")
    everything = table_dataset(table).to_table().sort_by("eid")
    assert everything.equals(DeltaTable(str(path)).to_pyarrow_table().sort_by("eid"))
    middle = table_dataset(table, "step", 2, 3)
    assert len(middle.files) == 3  # steps 2 and 3, and the file holding steps 2..5
    found = middle.to_table(filter=ds.field("step").isin([2, 3])).column("eid").to_pylist()
    assert sorted(found) == ["2-a", "2-b", "3-a", "3-b", "late-2"]
    assert len(table_dataset(table, "step", low=6).files) == 1


def test_a_table_with_deletion_vectors_is_refused_naming_the_feature(tmp_path: Path) -> None:
    schema = pa.schema([("step", pa.int64())])
    table = DeltaTable.create(
        str(tmp_path / "t"), schema, configuration={"delta.enableDeletionVectors": "true"}
    )
    with pytest.raises(DeltaProtocolError, match="deletionVectors"):
        table_dataset(table)


def test_a_commit_whose_values_hold_unicode_line_breaks_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "table"
    rows = pa.table({"eid": pa.array(["a\x85b", "c\u2028d\u2029e"])})
    open_or_create(path, rows.schema)
    write_deltalake(str(path), rows, mode="append")  # stats hold the values unescaped
    commit = read_commit(path, 1)
    assert commit is not None and len(commit.added_paths) == 1
    assert ds.dataset(str(path / commit.added_paths[0])).to_table().equals(rows)
