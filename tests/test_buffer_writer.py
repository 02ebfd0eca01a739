"""The validated experience writer: atomic appends, ingest_seq, quarantine with reasons."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.buffer import buffer_config, make_row, make_rows
from trinity_dagster.buffer import EXPERIENCE_SCHEMA, ExperienceWriter, PinResult, pin_batch
from trinity_dagster.paths import RunPaths


def _read(path) -> pa.Table:
    return DeltaTable(str(path)).to_pyarrow_table()


def test_good_rows_are_written_in_one_commit_with_ordered_seq(tmp_path):
    config = buffer_config(tmp_path)
    writer = ExperienceWriter(config)
    first = writer.write(make_rows("a", 3))
    second = writer.write(make_rows("b", 2))
    assert (first.written, first.quarantined) == (3, 0)
    assert (second.written, second.quarantined) == (2, 0)
    table = DeltaTable(str(RunPaths.of(config.run_root).experiences))
    # version 0 creates the table; each write is exactly one more commit
    assert table.version() == 2 == second.version
    rows = table.to_pyarrow_table().sort_by("ingest_seq")
    assert rows.schema.equals(EXPERIENCE_SCHEMA)
    assert rows.column("eid").to_pylist() == ["a-0", "a-1", "a-2", "b-0", "b-1"]
    assert rows.column("ingest_seq").to_pylist() == [
        (1 << 32) + 0,
        (1 << 32) + 1,
        (1 << 32) + 2,
        (2 << 32) + 0,
        (2 << 32) + 1,
    ]
    assert rows.column("tokens")[0].as_py() == [1, 2, 3, 4, 5]


def test_arrow_table_input_and_defaults(tmp_path):
    config = buffer_config(tmp_path)
    rows = make_rows("t", 2)
    for row in rows:
        del row["explorer_id"], row["created_at"], row["info"]
    report = ExperienceWriter(config).write(pa.Table.from_pylist(rows))
    assert report.written == 2
    out = _read(RunPaths.of(config.run_root).experiences)
    assert out.column("info").to_pylist() == ["{}", "{}"]
    assert out.column("explorer_id").to_pylist() == ["", ""]
    assert out.column("advantages").null_count == 2


def test_arrow_table_with_uncastable_column_quarantines_every_row(tmp_path):
    config = buffer_config(tmp_path)
    table = pa.Table.from_pylist(make_rows("t", 2)).set_column(
        4, "tokens", pa.array([["x"], ["y"]], pa.list_(pa.string()))
    )
    report = ExperienceWriter(config).write(table)
    assert (report.written, report.quarantined) == (0, 2)
    assert all(r.field == "tokens" and "tokens" in r.reason for r in report.reasons)


BAD_ROWS = {
    "logprobs": lambda r: r.update(logprobs=r["logprobs"] + [-0.1]),
    "action_mask": lambda r: r.update(action_mask=r["action_mask"] + [False]),
    "advantages": lambda r: r.update(advantages=[0.5] * (len(r["logprobs"]) + 1)),
    "returns": lambda r: r.update(returns=[0.5] * (len(r["logprobs"]) - 1) + [math.inf]),
    "reward": lambda r: r.update(reward=math.nan),
    "tokens": lambda r: r.update(prompt_length=len(r["tokens"]), action_mask=[], logprobs=[]),
    "model_version": lambda r: r.update(model_version=-1),
    "prompt_length": lambda r: r.update(prompt_length="3"),
    "info": lambda r: r.update(info="{not json"),
    "eid": lambda r: r.update(eid=""),
    "group_id": lambda r: r.pop("group_id"),
    "colour": lambda r: r.update(colour="red"),
    "ingest_seq": lambda r: r.update(ingest_seq=7),
    "created_at": lambda r: r.update(created_at="yesterday"),
}


@pytest.mark.parametrize("field", sorted(BAD_ROWS))
def test_each_bad_field_is_quarantined_and_named(tmp_path, field):
    config = buffer_config(tmp_path)
    bad = make_row("bad")
    BAD_ROWS[field](bad)
    report = ExperienceWriter(config).write([make_row("ok-1"), bad, make_row("ok-2")])
    assert (report.written, report.quarantined) == (2, 1)
    (rejection,) = report.reasons
    assert rejection.index == 1 and rejection.field == field and field in rejection.reason
    paths = RunPaths.of(config.run_root)
    assert sorted(_read(paths.experiences).column("eid").to_pylist()) == ["ok-1", "ok-2"]
    quarantined = _read(paths.quarantine).to_pylist()
    assert len(quarantined) == 1 and quarantined[0]["field"] == field
    assert quarantined[0]["source"] == "writer"
    assert json.loads(quarantined[0]["row_json"])["task_id"] == "task-g"


UNSTORABLE_ROWS = {
    "reward-huge-int": ("reward", lambda r: r.update(reward=10**400)),
    "logprobs-huge-int": ("logprobs", lambda r: r.update(logprobs=[10**400, -0.5])),
    "model_version-int64-overflow": ("model_version", lambda r: r.update(model_version=2**63)),
    "task_id-surrogate": ("task_id", lambda r: r.update(task_id="x\udcff")),
    "eid-surrogate-nan-reward": ("eid", lambda r: r.update(eid="x\udcff", reward=math.nan)),
    "info-text-surrogate": ("info", lambda r: r.update(info='{"k": "x\udcff"}')),
    "field-name-surrogate": ("x\udcff", lambda r: r.update({"x\udcff": 1})),
    "priority-huge-int": ("info", lambda r: r.update(info={"priority": 10**400})),
    "priority-text-overflows": ("info", lambda r: r.update(info='{"priority": 1e400}')),
    "priority-nan": ("info", lambda r: r.update(info='{"priority": NaN}')),
}


@pytest.mark.parametrize("case", sorted(UNSTORABLE_ROWS))
def test_unstorable_value_is_quarantined_and_good_rows_kept(tmp_path, case):
    """Values Arrow/Delta cannot store (or the sampler cannot rank) reject only their row."""
    field, mutate = UNSTORABLE_ROWS[case]
    config = buffer_config(tmp_path)
    bad = make_row("bad")
    mutate(bad)
    report = ExperienceWriter(config).write([make_row("ok-1"), bad, make_row("ok-2")])
    assert (report.written, report.quarantined) == (2, 1)
    (rejection,) = report.reasons
    assert rejection.index == 1 and rejection.field == field and field in rejection.reason
    paths = RunPaths.of(config.run_root)
    assert sorted(_read(paths.experiences).column("eid").to_pylist()) == ["ok-1", "ok-2"]
    (stored,) = _read(paths.quarantine).to_pylist()
    stored_field = field.encode("utf-8", "backslashreplace").decode()
    assert stored["field"] == stored_field and stored_field in stored["reason"]
    assert json.loads(stored["row_json"])["task_id"] == bad["task_id"]


def test_quarantined_row_with_invalid_utf8_eid_has_no_eid_but_keeps_it_in_row_json(tmp_path):
    config = buffer_config(tmp_path)
    bad = make_row("x\udcff", reward=math.nan)
    report = ExperienceWriter(config).write([make_row("ok"), bad])
    assert report.reasons[0].eid is None
    (stored,) = _read(RunPaths.of(config.run_root).quarantine).to_pylist()
    assert stored["eid"] is None
    assert json.loads(stored["row_json"])["eid"] == "x\udcff"


def test_numbers_arrow_would_reject_or_corrupt_are_stored_as_their_value(tmp_path):
    config = buffer_config(tmp_path)
    rows = [
        make_row("exact", reward=2**53 + 1, logprobs=[-(2**24) - 1, -1]),
        make_row("uint64", reward=np.uint64(2**64 - 1)),
    ]
    assert ExperienceWriter(config).write(rows).written == 2
    stored = _read(RunPaths.of(config.run_root).experiences).sort_by("ingest_seq").to_pylist()
    assert [r["reward"] for r in stored] == [float(2**53 + 1), float(2**64 - 1)]
    assert stored[0]["logprobs"] == [-float(2**24), -1.0]  # nearest float32


def test_priority_that_overflows_does_not_poison_the_priority_sampler(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2, sample_strategy="priority")
    writer = ExperienceWriter(config)
    bomb = make_row("bomb", info=json.dumps({"priority": 10**400}))
    report = writer.write([make_row("a", reward=0.5), bomb, make_row("b", reward=2.0)])
    assert report.reasons[0].reason.startswith("info.priority: expected a finite number")
    result = pin_batch(config, 1)
    assert isinstance(result, PinResult) and result.eids == ["b", "a"]


def test_a_single_row_instead_of_a_list_is_a_type_error(tmp_path):
    config = buffer_config(tmp_path)
    with pytest.raises(TypeError, match=r"got a single dict \(to write one row, pass \[row\]\)"):
        ExperienceWriter(config).write(make_row("one"))
    paths = RunPaths.of(config.run_root)
    assert not Path(paths.experiences).exists() and not Path(paths.quarantine).exists()


def test_too_long_and_unknown_version_and_duplicates(tmp_path):
    config = buffer_config(tmp_path)  # max_model_len = 24 + 8
    writer = ExperienceWriter(config, known_versions=lambda: {0, 1})
    writer.write([make_row("seen")])
    rows = [
        make_row("long", prompt=config.model.max_model_len, response=1),
        make_row("v9", version=9),
        make_row("dup"),
        make_row("dup"),
        make_row("seen"),
        make_row("fine", version=1),
    ]
    report = writer.write(rows)
    reasons = {r.index: r.reason for r in report.reasons}
    assert report.written == 2  # the first "dup" and "fine"
    assert "exceeds model.max_model_len 32" in reasons[0]
    assert reasons[1].startswith("model_version: 9 is not a known")
    assert "duplicated within the write" in reasons[3]
    assert "already in the experiences table" in reasons[4]
    # a fresh writer (another process) sees the committed eids too
    again = ExperienceWriter(config).write([make_row("fine")])
    assert again.written == 0 and again.reasons[0].field == "eid"


def test_write_with_only_bad_rows_makes_no_experience_commit(tmp_path):
    config = buffer_config(tmp_path)
    report = ExperienceWriter(config).write([make_row("x", reward=math.inf)])
    assert (report.written, report.version) == (0, None)
    assert DeltaTable(str(RunPaths.of(config.run_root).experiences)).version() == 0


MUTATIONS = sorted(k for k in BAD_ROWS if k not in ("eid",))


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    plan=st.lists(
        st.one_of(st.none(), st.sampled_from(MUTATIONS)),
        min_size=1,
        max_size=12,
    ),
    response=st.integers(min_value=1, max_value=4),
)
def test_fuzzed_mix_never_loses_a_good_row(tmp_path_factory, plan, response):
    config = buffer_config(tmp_path_factory.mktemp("fuzz"))
    rows, good, bad = [], [], {}
    for i, mutation in enumerate(plan):
        row = make_row(f"r{i}", response=response)
        if mutation is not None:
            BAD_ROWS[mutation](row)
            bad[i] = mutation
        else:
            good.append(f"r{i}")
        rows.append(row)
    report = ExperienceWriter(config).write(rows)
    assert report.written == len(good)
    assert report.quarantined == len(bad)
    assert {r.index: r.field for r in report.reasons} == bad
    assert all(r.field in r.reason for r in report.reasons)
    if good:
        written = _read(RunPaths.of(config.run_root).experiences).column("eid").to_pylist()
        assert sorted(written) == sorted(good)


def test_conflicting_commit_is_retried_renumbered_and_revalidated(tmp_path, monkeypatch):
    """A commit that loses the race is redone on the new snapshot: new seqs, eids rechecked."""
    import trinity_dagster.buffer.writer as writer_module

    config = buffer_config(tmp_path)
    ExperienceWriter(config).write([make_row("first")])
    real_write = writer_module.write_deltalake
    calls: list[tuple[str, ...]] = []
    race = [True]

    def racing_write(table, data, **kwargs):
        if race:  # another process commits between our snapshot and our commit
            race.clear()
            ExperienceWriter(config).write([make_row("rival"), make_row("both")])
        calls.append(tuple(data.column("eid").to_pylist()))
        return real_write(table, data, **kwargs)

    monkeypatch.setattr(writer_module, "write_deltalake", racing_write)
    report = ExperienceWriter(config).write([make_row("mine"), make_row("both")])
    # the first attempt failed with CommitFailedError and was redone without "both"
    assert calls == [("rival", "both"), ("mine", "both"), ("mine",)]
    assert (report.written, report.quarantined, report.version) == (1, 1, 3)
    assert "already in the experiences table" in report.reasons[0].reason
    rows = _read(RunPaths.of(config.run_root).experiences).sort_by("ingest_seq")
    assert rows.column("eid").to_pylist() == ["first", "rival", "both", "mine"]
    assert rows.column("ingest_seq").to_pylist() == [1 << 32, 2 << 32, (2 << 32) + 1, 3 << 32]


def test_long_lived_writers_see_each_others_eids(tmp_path):
    config = buffer_config(tmp_path)
    one, two = ExperienceWriter(config), ExperienceWriter(config)
    assert one.write([make_row("a")]).written == 1
    assert two.write([make_row("b"), make_row("a")]).written == 1  # "a" is one's
    assert one.write([make_row("c")]).written == 1
    for writer, eid in ((one, "b"), (two, "c"), (one, "a"), (two, "b")):
        report = writer.write([make_row(eid)])
        assert report.written == 0, eid
        assert "already in the experiences table" in report.reasons[0].reason
