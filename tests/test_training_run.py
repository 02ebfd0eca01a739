"""`trinity-dagster run` on an existing run root: what it keeps and what it lets go on."""

from pathlib import Path

import pytest

from trinity_dagster.buffer.end_of_data import end_of_data, mark_end_of_data
from trinity_dagster.commands.training_run import (
    TrainingRunError,
    accuracy_lines,
    extend_finished_run,
    find_workspace,
    held_out_accuracy,
)
from trinity_dagster.config import load_config
from trinity_dagster.explorer.eval_versions import versions_to_evaluate
from trinity_dagster.paths import RunPaths
from trinity_dagster.trainer.run_state import read_trainer_state, write_trainer_state


def test_a_run_that_stopped_early_is_extended_and_a_complete_one_is_kept(
    tmp_path: Path,
) -> None:
    paths = RunPaths.of(tmp_path / "run")
    assert not extend_finished_run(paths, 10)  # a fresh root has nothing to extend

    mark_end_of_data(paths, "explorer-0", "explored all 6 steps that trainer.total_steps needs")
    write_trainer_state(paths, "finished", 6, "trained all 6 steps (trainer.total_steps)")
    assert not extend_finished_run(paths, 6)  # same length: finished stays finished
    assert read_trainer_state(paths) is not None and end_of_data(paths) is not None

    assert extend_finished_run(paths, 10)  # more steps: the loop goes on
    assert read_trainer_state(paths) is None and end_of_data(paths) is None


def test_a_missing_workspace_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "workspace.yaml"
    with pytest.raises(TrainingRunError, match="--workspace") as err:
        find_workspace(missing)
    assert str(missing) in str(err.value)


def test_the_summary_reports_each_held_out_accuracy_with_its_interval(tmp_path: Path) -> None:
    config = load_config(None, {"run_root": str(tmp_path / "run")})
    name = "eval/two_digit_addition_eval"

    def metrics(accuracy: float, low: float, high: float) -> dict[str, float]:
        return {
            f"{name}/accuracy": accuracy,
            f"{name}/accuracy/ci95_low": low,
            f"{name}/accuracy/ci95_high": high,
            f"{name}/tasks": 500.0,
            "weights_version": 3,
        }

    evaluations = {"start": metrics(0.0, 0.0, 0.008), "end": metrics(0.372, 0.331, 0.415)}
    summary = held_out_accuracy(config, {**evaluations, "sft": {}})  # sft: not recorded
    assert summary == {
        "accuracy_start": 0.0,
        "accuracy_start_ci95": [0.0, 0.008],
        "accuracy_sft": None,
        "accuracy_sft_ci95": None,
        "accuracy_end": 0.372,
        "accuracy_end_ci95": [0.331, 0.415],
        "eval_tasks": 500,
    }
    assert accuracy_lines(summary) == [
        "held-out accuracy before training: 0.000 (95% CI 0.000-0.008)",
        "held-out accuracy after SFT: not recorded",
        "held-out accuracy after RL: 0.372 (95% CI 0.331-0.415)",
        "  (greedy, 500 held-out tasks)",
    ]


def test_the_sft_models_weights_are_evaluated_while_they_are_on_disk(tmp_path: Path) -> None:
    config = load_config(None, {"run_root": str(tmp_path / "run"), "trainer.sft_warmup_steps": 4})
    paths = RunPaths.of_config(config)
    assert versions_to_evaluate(config, paths, 10) == [0, 10]  # no weights of step 4 on disk

    exported = paths.checkpoints / "global_step_4" / "huggingface"
    exported.mkdir(parents=True)
    (exported / "config.json").write_text("{}")
    assert versions_to_evaluate(config, paths, 10) == [0, 4, 10]
    assert versions_to_evaluate(config, paths, 4) == [0, 4]  # all warm-up: 4 is the final
