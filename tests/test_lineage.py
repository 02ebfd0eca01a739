"""The lineage ledger, its three questions through `trinity-dagster lineage --json`, and the
`trained_exactly_once` proof catching a double pin, a skipped experience and a lost record.

The runs here are real buffer tables: experiences written by `ExperienceWriter` (as explore
steps), steps pinned by `pin_batch`, engine records written as the engine writes them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from assets.lineage import checkpoint_upstream
from tests.support.buffer import buffer_config, make_row, make_rows
from trinity_dagster import cli
from trinity_dagster.buffer.sampler import pin_batch
from trinity_dagster.buffer.writer import ExperienceWriter
from trinity_dagster.config import TrinityConfig
from trinity_dagster.lineage import ledger
from trinity_dagster.lineage.checkpoint_summary import read_summary, summary_path, write_summary
from trinity_dagster.lineage.ledger import update_ledger
from trinity_dagster.lineage.queries import LedgerView, checkpoint_lineage, checkpoint_totals
from trinity_dagster.lineage.verify import verify_trained_once
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import record_path, write_record


def explore(config: TrinityConfig, step: int, version: int, n: int = 4) -> list[str]:
    """Write explore step `step`'s rows (groups of 2) produced by weights `version`."""
    rows = make_rows(f"x{step}", n, group_size=2, version=version)
    report = ExperienceWriter(config).write(rows, explore_step=step)
    assert report.written == n
    return [row["eid"] for row in rows]


def train(config: TrinityConfig, step: int, current_version: int | None = None) -> list[str]:
    """Pin step `step` and leave the record the engine writes when it trained it."""
    result = pin_batch(config, step, current_version=current_version, force=True)
    write_record(RunPaths.of_config(config), {"step": step, "parent_step": step - 1})
    return result.eids


def lineage(capsys: pytest.CaptureFixture[str], root: Path, *args: str) -> tuple[int, Any]:
    """`trinity-dagster lineage --run-root ROOT ARGS --json`: exit status and the answer."""
    code = cli.main(["lineage", "--run-root", str(root), *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


@pytest.fixture
def run(tmp_path: Path) -> TrinityConfig:
    """Three explore steps (weights 0, 1, 2) and two trained steps of 4 rows each."""
    config = buffer_config(tmp_path / "run")
    for step in (1, 2, 3):
        explore(config, step, version=step - 1)
    train(config, 1)
    train(config, 2)
    return config


def test_the_three_questions_from_a_run_root(
    run: TrinityConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(run.run_root)
    code, answer = lineage(capsys, root, "--checkpoint", "2")
    assert code == 0
    assert answer["steps"] == 2 and answer["missing_steps"] == []
    assert answer["steps_without_record"] == []
    assert answer["experiences_trained"] == 8 and answer["experiences_dropped"] == 0
    assert answer["by_weights_version"] == {"0": 4, "1": 4}
    assert answer["initial_model"] == str(root / "weights" / "global_step_0")
    chain = answer["chain"]
    assert [(c["step"], c["parent"]) for c in chain] == [(1, 0), (2, 1)]
    batches = DeltaTable(str(root / "batches"))
    assert [c["batch_version"] for c in chain] == [1, 2] == [1, batches.version()]
    assert [c["by_weights_version"] for c in chain] == [{"0": 4}, {"1": 4}]

    code, answer = lineage(capsys, root, "--eid", "x2-3", "x3-0")
    assert code == 0
    (answer, waiting) = answer["eids"]
    assert answer["status"] == "trained" and answer["uses"] == [{"step": 2, "kind": "train"}]
    assert answer["model_version"] == 1
    assert answer["rollout"] == {"experiences_version": 2, "explorer_id": "ex0", "explore_step": 2}

    assert waiting["status"] == "unconsumed" and waiting["rollout"]["explore_step"] == 3
    assert waiting["uses"] == [] and waiting["ingest_seq"] >= waiting["cursor"]

    code, answer = lineage(capsys, root, "--weights", "1")
    assert code == 0
    assert answer["rollouts"] == [
        {"experiences_version": 2, "explorer_id": "ex0", "explore_step": 2, "rows": 4}
    ]
    assert answer["steps"] == {"2": 4} and answer["trained"] == 4

    code, answer = lineage(capsys, root, "--check")
    assert code == 0 and answer["passed"], answer
    assert answer["experiences_written"] == 12 and answer["experiences_trained"] == 8
    assert answer["experiences_unconsumed"] == 4 and answer["steps_trained"] == 2


def test_unknown_questions_fail_with_one_line(
    run: TrinityConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(run.run_root)
    assert cli.main(["lineage", "--run-root", str(root), "--eid", "nope"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"trinity-dagster lineage: no experience 'nope' in {root / 'experiences'}"
    )
    assert cli.main(["lineage", "--run-root", str(root), "--checkpoint", "9"]) == 1
    assert "step 9 has not been trained (newest trained step: 2)" in capsys.readouterr().err
    assert cli.main(["lineage", "--run-root", str(root / "absent"), "--check"]) == 1
    assert "no run root at" in capsys.readouterr().err
    assert cli.main(["lineage", "--run-root", str(root / "logs"), "--check"]) == 1
    assert "is not a run root" in capsys.readouterr().err
    assert not (root / "logs" / "ledger").exists()


def test_text_answers_for_people(run: TrinityConfig, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(run.run_root)
    assert cli.main(["lineage", "--run-root", root, "--checkpoint", "2"]) == 0
    text = capsys.readouterr().out
    assert "steps 1..2 from the initial model" in text and "no gap" in text
    assert "produced by weights v0: 4, v1: 4" in text
    assert cli.main(["lineage", "--run-root", root, "--check"]) == 0
    assert capsys.readouterr().out.startswith("trained_exactly_once: passed")


def test_updates_are_incremental_and_concurrent_ones_add_each_row_once(
    run: TrinityConfig,
) -> None:
    paths = RunPaths.of_config(run)
    first = update_ledger(paths)
    assert first.steps == (1, 2) and first.step_rows == 8 and first.rollout_rows == 3
    assert update_ledger(paths).step_rows == 0
    for step in (4, 5, 6):
        explore(run, step, version=step - 1)
    for step in (3, 4, 5):
        train(run, step)
    threads = [threading.Thread(target=update_ledger, args=(paths,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps = DeltaTable(paths.ledger_steps).to_pyarrow_table()
    assert sorted(steps.column("step").to_pylist()) == sorted(
        [s for s in range(1, 6) for _ in "1234"]
    )
    rollouts = DeltaTable(paths.ledger_rollouts).to_pyarrow_table()
    assert sorted(rollouts.column("explore_step").to_pylist()) == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_summary_is_stored_once_and_read_back_without_the_tables(
    run: TrinityConfig,
) -> None:
    paths = RunPaths.of_config(run)
    assert read_summary(paths, 2) is None
    stored = write_summary(paths, 2)
    assert stored == {
        "step": 2,
        "by_weights_version": {0: 4, 1: 4},
        "gaps": [],
        "experiences_trained": 8,
        "staleness_max": 0,
    }
    assert read_summary(paths, 2) == stored
    # what records checkpoint[2] in Dagster reads the summary, not the Delta tables
    shutil.rmtree(paths.root / "batches")
    metadata = checkpoint_upstream(paths, 2)
    assert metadata["lineage/steps"] == "1..2 from the initial model, no gap"
    assert metadata["lineage/experiences_trained"] == 8
    assert "partition=000001)" in metadata["upstream/weights_versions"].value
    # a torn summary counts as none
    summary_path(paths, 2).write_text('{"step": 2, "by_w')
    assert read_summary(paths, 2) is None


def test_a_checkpoint_summed_up_without_its_chain_names_the_same_gaps(
    run: TrinityConfig,
) -> None:
    paths = RunPaths.of_config(run)
    pin_batch(run, 3, force=True)  # pinned, but the engine left no record of training it
    write_record(paths, {"step": 4, "parent_step": 3})  # trained without a pinned batch
    update_ledger(paths)
    view = LedgerView.open(paths)
    full = checkpoint_lineage(view, 4)
    assert full["missing_steps"] == [4] and full["steps_without_record"] == [3]
    assert [entry["step"] for entry in full.pop("chain")] == [1, 2, 3]
    assert checkpoint_totals(view, 4) == full
    assert write_summary(paths, 4)["gaps"] == [3, 4]


def test_the_steps_table_is_compacted_as_it_grows(
    run: TrinityConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "COMPACT_AT_FILES", 3)
    paths = RunPaths.of_config(run)
    update_ledger(paths)
    for step in range(3, 8):
        explore(run, step + 1, version=step)
        train(run, step)
        update_ledger(paths)
    table = DeltaTable(paths.ledger_steps)
    assert len(table.file_uris()) <= 3
    assert table.to_pyarrow_table().num_rows == 7 * 4


def test_dropped_stale_rows_are_consumed_not_trained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = buffer_config(
        tmp_path / "run", train_batch_size=2, sample_strategy="staleness_control", max_staleness=1
    )
    writer = ExperienceWriter(config)
    writer.write([make_row("old", version=0), make_row("mid", version=1)], explore_step=1)
    writer.write([make_row("new1", version=2), make_row("new2", version=2)], explore_step=2)
    assert train(config, 1, current_version=2) == ["mid", "new1"]
    code, found = lineage(capsys, Path(config.run_root), "--eid", "old")
    (answer,) = found["eids"]
    assert answer["status"] == "dropped" and answer["uses"] == [{"step": 1, "kind": "stale"}]
    code, answer = lineage(capsys, Path(config.run_root), "--check")
    assert code == 0 and answer["passed"]
    assert answer["experiences_dropped"] == 1 and answer["experiences_trained"] == 2


def test_the_check_names_a_double_pin_a_skipped_experience_and_a_lost_record(
    run: TrinityConfig,
) -> None:
    paths = RunPaths.of_config(run)
    assert verify_trained_once(paths).passed
    batches = DeltaTable(paths.batches)
    step2 = batches.to_pyarrow_table(filters=[("step", "=", 2)])
    # step 3 pins x2-0 again and moves the cursor past all of explore step 3's rows
    again = step2.filter(pa.compute.equal(step2.column("eid"), "x2-0"))
    state = json.loads(again.column("sampler_state")[0].as_py())
    state.update(step=3, watermark=(4 << 32))
    again = again.set_column(
        again.schema.get_field_index("step"), "step", pa.array([3], pa.int64())
    ).set_column(
        again.schema.get_field_index("sampler_state"),
        "sampler_state",
        pa.array([json.dumps(state)]),
    )
    write_deltalake(batches, again, mode="append")
    write_record(paths, {"step": 3, "parent_step": 2})
    record_path(paths, 1).unlink()
    verdict = verify_trained_once(paths)
    assert not verdict.passed
    problems = "\n".join(verdict.problems)
    assert "steps without the engine's record: 1" in problems
    assert "1 experiences consumed by more than one step: x2-0" in problems
    assert "1 experiences trained more than 1 time(s): x2-0" in problems
    assert (
        f"4 experiences below the sampler's cursor ({4 << 32}) were never consumed: "
        "x3-0, x3-1, x3-2, x3-3" in problems
    )


def test_a_consumed_experience_missing_from_the_experiences_table_is_named(
    run: TrinityConfig,
) -> None:
    paths = RunPaths.of_config(run)
    DeltaTable(paths.experiences).delete("eid = 'x1-2'")
    verdict = verify_trained_once(paths)
    assert verdict.problems == ["1 consumed experiences are not in the experiences table: x1-2"]


def test_the_benchmark_builds_a_ledger_and_answers_from_it() -> None:
    # a small size, so the benchmark's own assertions on its answers run in every suite
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "benchmarks.bench_lineage", "--steps", "120", "--repeats", "1"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["steps"] == 120 and figures["ledger_rows"] == 120 * 256
    assert {"query_checkpoint_s", "query_eid_s", "query_weights_s"} <= figures.keys()


def test_a_run_root_named_relatively_with_its_config_yaml(
    run: TrinityConfig, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `run` and `demo` write the config they ran with, its run_root as the user gave it
    root = Path(run.run_root)
    (root / "config.yaml").write_text("run_root: run\nbuffer: {reuse_limit: 1}\n")
    monkeypatch.chdir(root.parent)
    code, answer = lineage(capsys, Path("run"), "--check")
    assert code == 0 and answer["passed"] and answer["steps_trained"] == 2
