"""Property: whatever values a batch holds, every row is either stored unchanged or quarantined."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import numpy as np
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.buffer import buffer_config, make_row
from trinity_dagster.buffer import ExperienceWriter
from trinity_dagster.paths import RunPaths

SURROGATE_TEXT = st.sampled_from(["x\udcff", "\ud800", "ok\udc80ok"])
HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 10**400, -(2**63) - 1])
JSON_NUMBERS = st.one_of(st.integers(), HUGE_INTS, st.floats())
NUMBERS = st.one_of(
    JSON_NUMBERS,
    st.booleans(),
    st.just(np.uint64(2**64 - 1)),
    st.just(np.float32(0.25)),
)
TEXT = st.one_of(st.text(max_size=8), SURROGATE_TEXT)
SCALARS = st.one_of(st.none(), NUMBERS, TEXT)
JSON_JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)
LISTS = st.lists(st.one_of(NUMBERS, st.none()), max_size=6)
INFOS = st.one_of(
    JSON_JUNK,
    st.dictionaries(st.just("priority"), SCALARS, min_size=1),
    st.builds(json.dumps, st.dictionaries(st.just("priority"), JSON_NUMBERS, min_size=1)),
    st.sampled_from(['{"priority": 1e400}', '{"k": "\udcff"}', "{not json", "[1, 2]"]),
)
# Junk for each column; a row replaces a few of its valid values with draws from these.
JUNK: dict[str, st.SearchStrategy[Any]] = {
    "eid": st.one_of(TEXT, st.integers(), st.none()),
    "task_id": SCALARS,
    "group_id": SCALARS,
    "explorer_id": SCALARS,
    "tokens": st.one_of(LISTS, SCALARS),
    "prompt_length": SCALARS,
    "action_mask": st.one_of(st.lists(st.one_of(st.booleans(), SCALARS), max_size=4), SCALARS),
    "logprobs": st.one_of(LISTS, SCALARS),
    "reward": SCALARS,
    "advantages": st.one_of(LISTS, SCALARS),
    "returns": st.one_of(LISTS, SCALARS),
    "model_version": SCALARS,
    "created_at": st.one_of(
        st.datetimes(timezones=st.just(dt.UTC)), st.datetimes(), st.none(), TEXT
    ),
    "info": INFOS,
    "colour": SCALARS,
}


@st.composite
def rows(draw: st.DrawFn, index: int) -> dict[str, Any]:
    """A valid row with up to two columns replaced by arbitrary values."""
    row = make_row(f"r{index}")
    for name in draw(st.sets(st.sampled_from(sorted(JUNK)), max_size=2)):
        row[name] = draw(JUNK[name])
    return row


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, Any]]:
    size = draw(st.integers(min_value=1, max_value=8))
    return [draw(rows(i)) for i in range(size)]


def _float32(value: Any) -> float:
    return float(np.float32(float(value)))


def _as_stored(row: dict[str, Any]) -> dict[str, Any]:
    """What the experiences table must hold for an accepted input row (before ingest_seq)."""
    info = row.get("info", "{}")
    floats = {
        name: None if row.get(name) is None else [_float32(x) for x in row[name]]
        for name in ("logprobs", "advantages", "returns")
    }
    return {
        **row,
        **floats,
        "explorer_id": row.get("explorer_id", ""),
        "tokens": [int(t) for t in row["tokens"]],
        "action_mask": [bool(b) for b in row["action_mask"]],
        "reward": float(row["reward"]),
        "info": json.dumps(info) if isinstance(info, dict) else info,
    }


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=batches())
def test_every_row_is_stored_unchanged_or_quarantined(tmp_path_factory, batch):
    config = buffer_config(tmp_path_factory.mktemp("prop"))
    report = ExperienceWriter(config).write(batch)
    assert report.written + report.quarantined == len(batch)
    rejected = {r.index for r in report.reasons}
    assert len(rejected) == report.quarantined
    paths = RunPaths.of(config.run_root)
    stored = DeltaTable(str(paths.experiences)).to_pyarrow_table().sort_by("ingest_seq")
    stored_rows = stored.drop_columns(["ingest_seq"]).to_pylist()
    expected = [_as_stored(row) for i, row in enumerate(batch) if i not in rejected]
    for got, want in zip(stored_rows, expected, strict=True):
        if want["created_at"] is None:  # filled with the write time
            want["created_at"] = got["created_at"]
        assert got == want
    if report.quarantined:
        quarantine = DeltaTable(str(paths.quarantine)).to_pyarrow_table()
        assert quarantine.num_rows == report.quarantined
        for field, reason in zip(
            quarantine.column("field").to_pylist(),
            quarantine.column("reason").to_pylist(),
            strict=True,
        ):
            assert reason.startswith(field)
