"""`trinity-dagster run` on an existing run root: what it keeps and what it lets go on."""

from pathlib import Path

import pytest

from trinity_dagster.buffer.end_of_data import end_of_data, mark_end_of_data
from trinity_dagster.commands.training_run import (
    TrainingRunError,
    extend_finished_run,
    find_workspace,
)
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
