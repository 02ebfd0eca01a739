"""The buffer's Delta tables stay cheap to open however many steps have committed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from trinity_dagster.buffer.tables import open_or_create


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
