"""Arrow table input to the writer: bad values reject only their row, as in the row path."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import trinity_dagster.buffer.validation as validation
from tests.support.buffer import buffer_config, make_row
from trinity_dagster.buffer import ExperienceWriter, WriteReport
from trinity_dagster.paths import RunPaths


def _write(root: Path, rows: list[dict[str, Any]] | pa.Table) -> WriteReport:
    return ExperienceWriter(buffer_config(root)).write(rows)


def _stored_eids(root: Path) -> list[str]:
    table = DeltaTable(RunPaths.of(root).experiences).to_pyarrow_table()
    return sorted(table.column("eid").to_pylist())


def _quarantined(root: Path) -> list[tuple[str | None, str, str]]:
    table = DeltaTable(RunPaths.of(root).quarantine).to_pyarrow_table()
    return sorted((r["eid"], r["field"], r["reason"]) for r in table.to_pylist())


def _rejections(report: WriteReport) -> list[tuple[int, str | None, str, str]]:
    return [(r.index, r.eid, r.field, r.reason) for r in report.reasons]


def _with_column(rows: list[dict[str, Any]], name: str, column: pa.Array) -> pa.Table:
    table = pa.Table.from_pylist(rows)
    return table.set_column(table.schema.get_field_index(name), name, column)


def test_an_out_of_range_token_id_rejects_only_its_row_with_the_row_path_reason(tmp_path):
    rows = [make_row("a"), make_row("b", tokens=[1, 2, 3, 2**31, 5]), make_row("c")]
    by_rows = _write(tmp_path / "rows", rows)
    by_table = _write(tmp_path / "table", pa.Table.from_pylist(rows))
    assert (by_table.written, by_table.quarantined) == (2, 1)
    assert _rejections(by_table) == _rejections(by_rows)
    assert _rejections(by_table) == [
        (1, "b", "tokens", "tokens[3]: expected int32 token ids >= 0, got 2147483648")
    ]
    assert _stored_eids(tmp_path / "table") == ["a", "c"]
    assert _quarantined(tmp_path / "table") == _quarantined(tmp_path / "rows")


def test_a_uint64_model_version_above_int64_rejects_only_its_row(tmp_path):
    rows = [make_row("a"), make_row("b"), make_row("c", version=1)]
    table = _with_column(rows, "model_version", pa.array([0, 2**63, 1], pa.uint64()))
    rows[1]["model_version"] = 2**63
    by_table = _write(tmp_path / "table", table)
    by_rows = _write(tmp_path / "rows", rows)
    assert (by_table.written, by_table.quarantined) == (2, 1)
    assert _rejections(by_table) == _rejections(by_rows)
    assert by_table.reasons[0].reason == (
        "model_version: out of range 0..9223372036854775807 (9223372036854775808)"
    )
    stored = DeltaTable(RunPaths.of(tmp_path / "table").experiences).to_pyarrow_table()
    assert sorted(stored.column("model_version").to_pylist()) == [0, 1]


def test_naive_timestamps_are_refused_per_row_as_in_the_row_path(tmp_path):
    rows = [make_row(eid, created_at=dt.datetime(2026, 1, 1)) for eid in ("a", "b")]
    by_table = _write(tmp_path / "table", pa.Table.from_pylist(rows))
    by_rows = _write(tmp_path / "rows", rows)
    assert (by_table.written, by_table.quarantined) == (0, 2)
    assert _rejections(by_table) == _rejections(by_rows)
    assert by_table.reasons[0].reason.startswith(
        "created_at: expected a timezone-aware datetime, got datetime.datetime(2026, 1, 1"
    )
    assert DeltaTable(RunPaths.of(tmp_path / "table").experiences).version() == 0


# Values of a kind the row path refuses, which an arrow cast would convert without complaint.
WRONG_KINDS = {
    "prompt_length-text": ("prompt_length", ["3", "3"], pa.string()),
    "prompt_length-bool": ("prompt_length", [True, True], pa.bool_()),
    "prompt_length-float": ("prompt_length", [3.0, 3.0], pa.float64()),
    "model_version-float": ("model_version", [0.0, 0.0], pa.float64()),
    "created_at-int": ("created_at", [1, 1], pa.int64()),
    "tokens-floats": ("tokens", [[1.0, 2.0, 3.0, 4.0, 5.0]] * 2, pa.list_(pa.float64())),
}


@pytest.mark.parametrize("case", sorted(WRONG_KINDS))
def test_a_value_of_the_wrong_kind_gets_the_row_path_reason(tmp_path, case):
    name, values, arrow_type = WRONG_KINDS[case]
    bad = [make_row(eid, **{name: value}) for eid, value in zip(("b1", "b2"), values, strict=True)]
    table = _with_column(bad, name, pa.array(values, arrow_type))
    by_table = _write(tmp_path / "table", table)
    by_rows = _write(tmp_path / "rows", bad)
    assert (by_table.written, by_table.quarantined) == (0, 2)
    assert _rejections(by_table) == _rejections(by_rows)
    assert all(r.field == name and name in r.reason for r in by_table.reasons)


def test_integers_in_float_columns_are_stored_as_float_does_in_the_row_path(tmp_path):
    rows = [make_row("exact", reward=2**53 + 1), make_row("small", reward=2)]
    table = _with_column(rows, "reward", pa.array([2**53 + 1, 2], pa.int64()))
    assert _write(tmp_path, table).written == 2
    stored = DeltaTable(RunPaths.of(tmp_path).experiences).to_pyarrow_table()
    assert sorted(stored.column("reward").to_pylist()) == [2.0, float(2**53 + 1)]


def test_a_slice_is_judged_by_its_own_rows_only(tmp_path):
    rows = [make_row("a"), make_row("b"), make_row("bad", tokens=[1, 2, 3, 2**31, 5])]
    report = _write(tmp_path, pa.Table.from_pylist(rows).slice(0, 2))
    assert (report.written, report.quarantined) == (2, 0)
    assert _stored_eids(tmp_path) == ["a", "b"]


def test_an_all_good_table_is_not_checked_row_by_row(tmp_path, monkeypatch):
    def per_row_check(name: str, value: Any) -> str | None:
        raise AssertionError(f"row-by-row check of {name} on an all-good table")

    monkeypatch.setattr(validation, "_check_field", per_row_check)
    rows = [make_row(f"r{i}") for i in range(50)]
    assert _write(tmp_path, pa.Table.from_pylist(rows)).written == 50
