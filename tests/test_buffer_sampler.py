"""Batch pinning: strategies, idempotence, ordering, not-enough-data, sampler state."""

from __future__ import annotations

import json

import pytest
from deltalake import DeltaTable

from tests.support.buffer import buffer_config, make_row, make_rows
from trinity_dagster.buffer import (
    ExperienceWriter,
    NotEnoughDataError,
    PinOrderError,
    PinResult,
    PinShortfall,
    SamplerState,
    load_step_batch,
    pin_batch,
    sampler_state,
    table_stats,
    unconsumed_count,
)
from trinity_dagster.buffer.reader import StepBatches
from trinity_dagster.buffer.sampler import BatchPinner
from trinity_dagster.buffer.state import SamplerStateError
from trinity_dagster.buffer.tables import HELD_TABLE_COMMITS
from trinity_dagster.paths import RunPaths


def _pin(config, step, **kwargs) -> PinResult:
    result = pin_batch(config, step, **kwargs)
    assert isinstance(result, PinResult), result
    return result


def test_fifo_rows_oldest_first_and_never_twice(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=3)
    writer = ExperienceWriter(config)
    writer.write(make_rows("a", 4))
    writer.write(make_rows("b", 4))
    assert _pin(config, 1).eids == ["a-0", "a-1", "a-2"]
    assert _pin(config, 2).eids == ["a-3", "b-0", "b-1"]
    third = pin_batch(config, 3)
    assert third == PinShortfall(have=2, need=3) and third.message == "have 2, need 3"
    writer.write(make_rows("c", 1))
    assert _pin(config, 3).eids == ["b-2", "b-3", "c-0"]
    assert load_step_batch(config, 2).column("eid").to_pylist() == ["a-3", "b-0", "b-1"]


def test_a_pinner_kept_open_pins_what_fresh_pins_would_and_sees_other_pinners(tmp_path):
    """The trainer's pinner keeps its last state in memory; a pin by someone else (here a
    fresh `pin_batch`, as a second trainer would) between two of its pins is read, not
    overwritten: the batches are those of fresh pins throughout."""
    kept, fresh = (buffer_config(tmp_path / name, train_batch_size=3) for name in ("k", "f"))
    for config in (kept, fresh):
        ExperienceWriter(config).write(make_rows("a", 7))
    pinner = BatchPinner(kept)
    assert pinner.pin(1).eids == _pin(fresh, 1).eids == ["a-0", "a-1", "a-2"]
    assert _pin(kept, 2).eids == _pin(fresh, 2).eids == ["a-3", "a-4", "a-5"]  # not the pinner
    assert pinner.pin(2).already_pinned
    assert pinner.pin(3) == pin_batch(fresh, 3) == PinShortfall(have=1, need=3)
    for config in (kept, fresh):
        ExperienceWriter(config).write(make_rows("b", 2))
    assert pinner.pin(3).eids == _pin(fresh, 3).eids == ["a-6", "b-0", "b-1"]
    for config in (kept, fresh):
        ExperienceWriter(config).write(make_rows("c", 4))
    assert pinner.pin(4).eids == _pin(fresh, 4).eids == ["c-0", "c-1", "c-2"]  # from memory
    for step in (1, 2, 3, 4):
        assert load_step_batch(kept, step).equals(load_step_batch(fresh, step))
        assert sampler_state(kept, step) == sampler_state(fresh, step)


def test_held_tables_stay_current_past_their_reopening(tmp_path):
    """A writer and a pinner kept for more commits than a held table follows before it is
    reopened (`HELD_TABLE_COMMITS`) write and pin what fresh ones do."""
    kept, fresh = (buffer_config(tmp_path / name, train_batch_size=2) for name in ("k", "f"))
    writer, pinner = ExperienceWriter(kept), BatchPinner(kept)
    steps = HELD_TABLE_COMMITS + 5
    for step in range(1, steps + 1):
        rows = make_rows(f"s{step}-", 3)
        assert writer.write(rows).written == ExperienceWriter(fresh).write(rows).written == 3
        assert pinner.pin(step).eids == _pin(fresh, step).eids
    assert writer.write(make_rows(f"s{steps}-", 1)).written == 0  # a duplicate eid is refused
    reader = StepBatches(RunPaths.of(kept.run_root))
    for step in (1, steps):
        assert reader.load(step).equals(load_step_batch(fresh, step))


def test_groups_are_pinned_whole_in_completion_order(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=4, batch_unit="groups", repeat_times=2)
    writer = ExperienceWriter(config)
    writer.write([make_row("x0", group="x"), make_row("y0", group="y"), make_row("y1", group="y")])
    # only y is complete: one group of 2 rows, a batch needs 4
    assert pin_batch(config, 1) == PinShortfall(have=2, need=4)
    writer.write([make_row("z0", group="z"), make_row("z1", group="z")])
    writer.write([make_row("x1", group="x")])
    first = _pin(config, 1)
    assert first.eids == ["y0", "y1", "z0", "z1"]  # x completed last
    writer.write([make_row("w0", group="w"), make_row("w1", group="w")])
    assert _pin(config, 2).eids == ["x0", "x1", "w0", "w1"]
    assert unconsumed_count(config) == 0


def test_repin_is_idempotent_and_order_is_enforced(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2)
    ExperienceWriter(config).write(make_rows("a", 6))
    first = _pin(config, 1)
    again = _pin(config, 1)
    assert again.already_pinned and not first.already_pinned
    assert first.newly_pinned and not again.newly_pinned
    assert again.eids == first.eids and again.state == first.state
    assert again.source_version == first.source_version
    # the pinning call hands back the rows it pinned, as a read of the batch gives them
    assert first.rows is not None and again.rows is None
    assert first.rows.equals(load_step_batch(config, 1))
    with pytest.raises(PinOrderError, match="cannot pin step 3: step 2 is not pinned"):
        pin_batch(config, 3)
    with pytest.raises(ValueError, match="step must be >= 1"):
        pin_batch(config, 0)
    _pin(config, 2)
    batches = DeltaTable(str(RunPaths.of(config.run_root).batches))
    assert batches.to_pyarrow_table().num_rows == 4
    assert batches.version() == 2  # create + two pins; the re-pin committed nothing


def test_not_enough_data_with_force_raises(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=4)
    assert pin_batch(config, 1) == PinShortfall(have=0, need=4)
    ExperienceWriter(config).write(make_rows("a", 3))
    with pytest.raises(NotEnoughDataError, match="have 3, need 4"):
        pin_batch(config, 1, force=True)


def test_staleness_control_drops_and_records(tmp_path):
    config = buffer_config(
        tmp_path,
        train_batch_size=2,
        sample_strategy="staleness_control",
        max_staleness=1,
    )
    writer = ExperienceWriter(config)
    writer.write([make_row("old", version=0), make_row("mid", version=1)])
    writer.write([make_row("new1", version=2), make_row("new2", version=2)])
    result = _pin(config, 1, current_version=2)
    assert result.eids == ["mid", "new1"]
    assert result.dropped == ["old"]
    quarantine = DeltaTable(str(RunPaths.of(config.run_root).quarantine)).to_pyarrow_table()
    (record,) = quarantine.to_pylist()
    assert record["eid"] == "old" and record["step"] == 1 and record["source"] == "sampler"
    assert record["reason"].startswith("stale: model_version 0 is 2 behind")
    assert json.loads(record["row_json"])["eid"] == "old"
    # the dropped row is resolved: never pinned later
    writer.write([make_row("new3", version=2)])
    assert _pin(config, 2, current_version=2).eids == ["new2", "new3"]
    assert "old" not in load_step_batch(config, 1).column("eid").to_pylist()


def test_staleness_control_drops_whole_group(tmp_path):
    config = buffer_config(
        tmp_path,
        train_batch_size=2,
        batch_unit="groups",
        repeat_times=2,
        sample_strategy="staleness_control",
        max_staleness=0,
    )
    writer = ExperienceWriter(config)
    writer.write([make_row("a0", group="a", version=0), make_row("a1", group="a", version=1)])
    writer.write([make_row("b0", group="b", version=1), make_row("b1", group="b", version=1)])
    result = _pin(config, 1, current_version=1)
    assert result.eids == ["b0", "b1"] and result.dropped == ["a0", "a1"]


def test_priority_highest_first_with_reuse_limit(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2, sample_strategy="priority", reuse_limit=2)
    writer = ExperienceWriter(config)
    writer.write(
        [
            make_row("low", reward=0.1),
            make_row("neg", reward=-3.0),  # |reward| = 3
            make_row("tagged", reward=0.0, info=json.dumps({"priority": 5})),
            make_row("mid", reward=1.0),
        ]
    )
    assert _pin(config, 1).eids == ["tagged", "neg"]
    assert _pin(config, 2).eids == ["tagged", "neg"]  # second and last use
    assert _pin(config, 3).eids == ["mid", "low"]
    state = sampler_state(config, 3)
    assert state.uses == {"low": 1, "mid": 1}
    assert _pin(config, 4).eids == ["mid", "low"]
    assert pin_batch(config, 5) == PinShortfall(have=0, need=2)


def test_sampler_state_json_round_trip_and_errors(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2)
    ExperienceWriter(config).write(make_rows("a", 3))
    result = _pin(config, 1)
    restored = SamplerState.from_json(json.dumps(result.state.to_dict()))
    assert restored == result.state == sampler_state(config, 1)
    assert restored.watermark == (1 << 32) + 2  # a-2 is the oldest pending row
    assert sampler_state(config, 0) == SamplerState()
    with pytest.raises(SamplerStateError, match="'watermark' must be an integer"):
        SamplerState.from_json({"step": 1, "watermark": "x", "source_version": 0})
    with pytest.raises(LookupError, match="step 2 is not pinned"):
        sampler_state(config, 2)


def test_table_stats_counts(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2)
    writer = ExperienceWriter(config)
    writer.write([*make_rows("a", 3), make_row("bad", reward=float("nan"))])
    writer.write(make_rows("b", 2))
    _pin(config, 1)
    stats = table_stats(config)
    assert stats == {
        "row_count": 5,
        "table_version": 2,
        "unconsumed": 3,
        "last_pinned_step": 1,
        "quarantined": 1,
    }


def test_concurrent_pinners_of_one_step_agree(tmp_path, monkeypatch):
    """Two pinners of step 1: the loser's commit conflicts and it returns the winner's rows."""
    import trinity_dagster.buffer.sampler as sampler_module

    config = buffer_config(tmp_path, train_batch_size=2)
    ExperienceWriter(config).write(make_rows("a", 3))
    real_write = sampler_module.write_deltalake
    race = [True]
    rival: list[PinResult] = []

    def racing_write(table, data, **kwargs):
        if race:
            race.clear()
            rival.append(_pin(config, 1))
        return real_write(table, data, **kwargs)

    monkeypatch.setattr(sampler_module, "write_deltalake", racing_write)
    ours = _pin(config, 1)
    assert ours.already_pinned and not rival[0].already_pinned
    assert ours.eids == rival[0].eids == ["a-0", "a-1"]
    batches = DeltaTable(str(RunPaths.of(config.run_root).batches)).to_pyarrow_table()
    assert batches.num_rows == 2


@pytest.mark.parametrize("priority", ["1e999", "NaN", "-Infinity", "1" + "0" * 400])
def test_a_stored_priority_beyond_a_finite_float_falls_back_to_the_reward(priority: str) -> None:
    from trinity_dagster.buffer.strategies import row_priority

    assert row_priority(-0.5, '{"priority": ' + priority + "}") == 0.5
    assert row_priority(-0.5, '{"priority": 2}') == 2.0
