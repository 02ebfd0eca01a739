"""Explorer and demonstration rows pass the buffer writer, read back intact and get pinned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from trinity_dagster.buffer.sampler import PinResult, pin_batch
from trinity_dagster.buffer.writer import ExperienceWriter
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.config import load_config
from trinity_dagster.explorer.demonstrations import demonstration_rows
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.explorer.loop import rows_for_writer
from trinity_dagster.paths import RunPaths

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rows_are_accepted_by_the_writer_and_read_back(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        {
            "run_root": str(tmp_path / "run"),
            "algorithm.repeat_times": 4,
            "explorer.tasks_per_step": 3,
            "buffer.train_batch_size": 32,
        },
    )
    paths = RunPaths.of(cfg.run_root)
    create_initial_model(cfg, paths)
    explored = Explorer(cfg, paths).explore(step=1)
    demos = demonstration_rows(cfg, n=cfg.buffer.train_batch_size, seed=1)
    rows = explored + demos
    report = ExperienceWriter(cfg, known_versions=lambda: {0}).write(rows)
    assert (report.written, report.quarantined) == (len(rows), 0), report.reasons
    stored = DeltaTable(str(paths.experiences)).to_pyarrow_table().to_pylist()
    by_eid = {row["eid"]: row for row in stored}
    assert set(by_eid) == {row["eid"] for row in rows}
    for row in rows:
        back = by_eid[row["eid"]]
        for key in ("task_id", "group_id", "explorer_id", "tokens", "prompt_length", "info"):
            assert back[key] == row[key]
        assert back["action_mask"] == row["action_mask"]
        assert back["reward"] == row["reward"] and back["model_version"] == 0
        np.testing.assert_allclose(back["logprobs"], row["logprobs"], rtol=1e-6)
    # whole groups of repeat_times rows, oldest first: the 3 explored groups, then 5 demo groups
    pinned = pin_batch(cfg, 1)
    assert isinstance(pinned, PinResult)
    assert sorted(pinned.eids) == sorted(r["eid"] for r in explored + demos[:20])


def loop_in_a_fresh_process(overrides: dict[str, object], run: str) -> list[str]:
    """The output lines of a fresh interpreter that makes `loop`, an `ExplorerLoop` of the
    config `overrides`, runs the statements `run` and prints which of torch and transformers'
    model classes it imported by then."""
    code = (
        "import sys\n"
        "from trinity_dagster.config import load_config\n"
        "from trinity_dagster.explorer.loop import ExplorerLoop\n"
        f"loop = ExplorerLoop(load_config(None, {overrides!r}))\n"
        f"{run}\n"
        "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_loop_writes_the_sft_demonstrations_without_loading_torch(tmp_path: Path) -> None:
    """Demonstrations need only the tokenizer, so the SFT warm-up's explore steps are written
    (and training can start) before the explorer process has spent seconds importing torch."""
    root = tmp_path / "run"
    overrides = {"run_root": str(root), "trainer.sft_warmup_steps": 2, "trainer.total_steps": 4}
    assert loop_in_a_fresh_process(overrides, "print(loop.run(1, 2))") == [
        "explored up to step 2, the end of the requested range",
        "[]",
    ]
    stored = DeltaTable(str(RunPaths.of(root).experiences)).to_pyarrow_table()
    config = load_config(None, overrides)
    assert stored.num_rows == 2 * config.buffer.train_batch_size
    assert stored.column("explorer_id").unique().to_pylist() == ["demonstrations"]


def test_the_first_step_that_generates_loads_torch_only_once_its_weights_came(
    tmp_path: Path,
) -> None:
    """Waiting for the weights of its first RL step (training the warm-up meanwhile), the
    loop has still not imported torch: the import would take a core from those steps."""
    overrides = {
        "run_root": str(tmp_path / "run"),
        "trainer.sft_warmup_steps": 2,
        "trainer.total_steps": 4,
        "synchronizer.sync_timeout": 0.5,
    }
    run = "try:\n    loop.run(1, 3)\nexcept TimeoutError as err:\n    print(err)"
    assert loop_in_a_fresh_process(overrides, run) == [
        "explore step 3 needs weights version >= 2; none came within "
        "synchronizer.sync_timeout (0.5 s)",
        "[]",
    ]


def test_the_explorers_rows_go_to_the_writer_as_one_table_with_the_same_outcome(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, {"run_root": str(tmp_path / "run"), "buffer.train_batch_size": 16})
    rows = demonstration_rows(cfg, n=16, seed=3)
    rows[2]["reward"] = float("nan")  # a reward function's NaN
    rows[5]["logprobs"] = [float("inf")] * len(rows[5]["logprobs"])
    table = rows_for_writer(rows)
    assert isinstance(table, pa.Table) and table.num_rows == 16

    outcomes = []
    for name, given in (("as_rows", rows), ("as_table", table)):
        run = load_config(None, {"run_root": str(tmp_path / name)})
        report = ExperienceWriter(run).write(given, explore_step=1)
        stored = DeltaTable(str(RunPaths.of(run.run_root).experiences)).to_pyarrow_table()
        reasons = [(r.index, r.eid, r.field) for r in report.reasons]  # wording may differ
        outcomes.append((stored.drop_columns(["ingest_seq"]).to_pylist(), reasons))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == [
        (2, rows[2]["eid"], "reward"),
        (5, rows[5]["eid"], "logprobs"),
    ]

    rows[7]["tokens"] = [*rows[7]["tokens"][:-1], 2**40]  # no int32 holds it: row by row
    assert rows_for_writer(rows) is rows
    report = ExperienceWriter(load_config(None, {"run_root": str(tmp_path / "big")})).write(rows)
    assert (rows[7]["eid"], "tokens") in [(r.eid, r.field) for r in report.reasons]
