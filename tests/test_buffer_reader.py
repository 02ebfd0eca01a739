"""Reading pinned batches, tensors for training, and replay after maintenance."""

from __future__ import annotations

import pytest
import torch
from deltalake import DeltaTable

from tests.support.buffer import buffer_config, make_row, make_rows
from trinity_dagster.buffer import (
    ExperienceWriter,
    StepNotPinnedError,
    compact,
    load_step_batch,
    pin_batch,
    to_tensors,
    unconsumed_count,
    vacuum,
)
from trinity_dagster.buffer.reader import StepBatches, rows_of_pin
from trinity_dagster.paths import RunPaths


def test_to_tensors_aligns_response_values_with_their_tokens(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2)
    rows = [
        make_row(
            "a",
            group="g1",
            tokens=[5, 6, 7, 8, 9],
            prompt_length=2,
            action_mask=[True, False, True],
            logprobs=[-0.1, -0.2, -0.3],
            reward=1.5,
            model_version=3,
            advantages=[1.0, 2.0, 3.0],
        ),
        make_row(
            "b",
            group="g0",
            tokens=[4, 3, 2],
            prompt_length=2,
            action_mask=[True],
            logprobs=[-0.7],
            reward=-1.0,
            model_version=2,
            advantages=[4.0],
        ),
    ]
    ExperienceWriter(config).write(rows)
    pin_batch(config, 1, force=True)
    batch = load_step_batch(config, 1)
    assert batch.column("eid").to_pylist() == ["a", "b"]
    out = to_tensors(batch, pad_to=6)
    assert out["tokens"].tolist() == [[5, 6, 7, 8, 9, 0], [4, 3, 2, 0, 0, 0]]
    assert out["tokens"].dtype == torch.int64
    assert out["attention_mask"].tolist() == [
        [True, True, True, True, True, False],
        [True, True, True, False, False, False],
    ]
    assert out["response_mask"].tolist() == [
        [False, False, True, False, True, False],
        [False, False, True, False, False, False],
    ]
    expected = torch.tensor(
        [[0, 0, -0.1, -0.2, -0.3, 0], [0, 0, -0.7, 0, 0, 0]], dtype=torch.float32
    )
    assert torch.equal(out["old_logprobs"], expected)
    assert out["advantages"].tolist() == [[0, 0, 1, 2, 3, 0], [0, 0, 4, 0, 0, 0]]
    assert out["rewards"].tolist() == [1.5, -1.0]
    assert out["group_index"].tolist() == [0, 1]
    assert out["model_version"].tolist() == [3, 2]
    assert "returns" not in out
    assert to_tensors(batch)["tokens"].shape == (2, 5)
    with pytest.raises(ValueError, match="pad_to 4 is shorter than the longest row"):
        to_tensors(batch, pad_to=4)


def test_advantages_only_when_every_row_has_them(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=2)
    ExperienceWriter(config).write([make_row("a", advantages=[1.0, 1.0]), make_row("b")])
    pin_batch(config, 1, force=True)
    out = to_tensors(load_step_batch(RunPaths.of(config.run_root), 1))
    assert "advantages" not in out
    assert out["group_index"].tolist() == [0, 0]


def test_unpinned_step_is_a_clear_error(tmp_path):
    config = buffer_config(tmp_path)
    with pytest.raises(StepNotPinnedError, match="step 1 is not pinned"):
        load_step_batch(config, 1)
    ExperienceWriter(config).write(make_rows("a", 4))
    pin_batch(config, 1, force=True)
    with pytest.raises(StepNotPinnedError, match="step 2 is not pinned"):
        load_step_batch(config.run_root, 2)


def test_replay_after_compaction_and_vacuum_is_identical(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=3)
    writer = ExperienceWriter(config)
    for i in range(6):
        writer.write([*make_rows(f"w{i}", 2), make_row(f"bad{i}", reward=float("inf"))])
    before = {}
    for step in (1, 2, 3):
        pin_batch(config, step, force=True)
        before[step] = load_step_batch(config, step)
    paths = RunPaths.of(config.run_root)
    files_before = len(DeltaTable(str(paths.experiences)).file_uris())
    assert unconsumed_count(config) == 12 - 9
    counts = compact(config)
    assert unconsumed_count(config) == 3  # now counted inside one file straddling the cursor
    assert counts["experiences"]["files_removed"] == files_before
    assert counts["experiences"]["files_added"] == 1
    deleted = vacuum(config, retention_hours=0, enforce_retention_duration=False)
    assert deleted["experiences"] == files_before
    assert deleted["batches"] >= 3
    for step, table in before.items():
        assert load_step_batch(config, step).equals(table)
        assert pin_batch(config, step).eids == table.column("eid").to_pylist()
    # pinning goes on after maintenance, with no row pinned twice
    result = pin_batch(config, 4, force=True)
    pinned = [e for s in (1, 2, 3) for e in before[s].column("eid").to_pylist()]
    assert not set(result.eids) & set(pinned)
    with pytest.raises(ValueError, match="retention_hours must be >= 0"):
        vacuum(config, retention_hours=-1)


def test_rows_of_a_pin_commit_are_the_step_rows_and_anything_else_falls_back(tmp_path):
    config = buffer_config(
        tmp_path, train_batch_size=2, sample_strategy="staleness_control", max_staleness=1
    )
    writer = ExperienceWriter(config)
    writer.write([make_row("old", version=0), make_row("mid", version=1)])
    writer.write([make_row("new1", version=2), make_row("new2", version=2)])
    writer.write(make_rows("later", 2, version=2))
    first = pin_batch(config, 1, current_version=2, force=True)  # drops "old" as stale
    second = pin_batch(config, 2, current_version=2, force=True)
    assert first.dropped == ["old"] and first.batch_version is not None
    assert second.batch_version is not None
    paths = RunPaths.of(config.run_root)
    scanned = {step: load_step_batch(config, step) for step in (1, 2)}
    assert scanned[1].column("eid").to_pylist() == ["mid", "new1"]  # the stale row is not trained

    direct = rows_of_pin(paths.batches, 1, first.batch_version)
    assert direct is not None and direct.equals(scanned[1])
    assert rows_of_pin(paths.batches, 2, first.batch_version) is None  # step 1's commit
    assert rows_of_pin(paths.batches, 2, second.batch_version + 5) is None  # no such commit
    reader = StepBatches(paths)
    assert reader.load(2, first.batch_version).equals(scanned[2])  # the wrong commit: scanned

    compact(config)
    vacuum(config, retention_hours=0, enforce_retention_duration=False)
    assert rows_of_pin(paths.batches, 2, second.batch_version) is None  # its file is gone
    assert reader.load(2, second.batch_version).equals(scanned[2])
