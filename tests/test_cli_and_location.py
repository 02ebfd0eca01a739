"""The console command and the Dagster code location, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*cmd: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_config_show_prints_resolved_config(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer:\n  total_steps: 9\nrun_root: r\n")
    out = run(str(BIN / "trinity-dagster"), "config", "show", "-c", str(cfg_file))
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["trainer"]["total_steps"] == 9
    assert shown["run_root"] == str((tmp_path / "r").resolve())
    assert shown["synchronizer"]["sync_interval"] == 1  # defaults filled in


def test_config_show_reports_bad_key_with_exit_2(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer:\n  sav_interval: 9\n")
    out = run(str(BIN / "trinity-dagster"), "config", "show", "-c", str(cfg_file))
    assert out.returncode == 2
    assert "trainer.sav_interval: unknown key" in out.stderr
    assert str(cfg_file) in out.stderr


def test_config_show_refuses_a_key_given_twice_in_one_line(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer:\n  total_steps: 9\ntrainer:\n  seed: 1\n")
    out = run(str(BIN / "trinity-dagster"), "config", "show", "-c", str(cfg_file))
    assert out.returncode == 2
    assert out.stderr == (
        f"trinity-dagster: invalid configuration in {cfg_file}: trainer: given twice, on lines "
        "1 and 3 (YAML would silently keep only the last)\n"
    )


@pytest.mark.parametrize("command", [("config", "show"), ("run",)])
def test_a_missing_task_file_fails_at_once_in_one_line(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("run_root: r\nexplorer:\n  taskset: tasks.jsonl\n")
    out = run(str(BIN / "trinity-dagster"), *command, "-c", str(cfg_file))
    assert out.returncode == 2
    missing = (tmp_path / "tasks.jsonl").resolve()
    assert (
        out.stderr
        == f"trinity-dagster: missing input: explorer.taskset: no such task file: {missing}\n"
    )
    assert not (tmp_path / "r").exists()  # nothing started


@pytest.mark.parametrize("command", ["run", "demo"])
@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_below_one_are_refused(tmp_path: Path, command: str, steps: str) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"run_root: {tmp_path / 'r'}\n")
    options = ["-c", str(cfg_file)] if command == "run" else ["--root", str(tmp_path / "r")]
    out = run(str(BIN / "trinity-dagster"), command, *options, "--steps", steps)
    assert out.returncode == 2
    assert f"argument --steps: must be at least 1, got {steps}" in out.stderr
    assert not (tmp_path / "r").exists()


def test_run_without_a_workspace_fails_with_the_cause_and_no_traceback(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"run_root: {tmp_path / 'r'}\n")
    missing = tmp_path / "nowhere" / "workspace.yaml"
    out = run(str(BIN / "trinity-dagster"), "run", "-c", str(cfg_file), "--workspace", str(missing))
    assert out.returncode == 1
    assert out.stderr.startswith(f"trinity-dagster: no Dagster workspace at {missing}"), out.stderr
    assert "Traceback" not in out.stderr


def test_code_location_imports_neither_torch_nor_the_data_libraries() -> None:
    """The code server loads the definitions and runs the sensors for a whole training: the
    asset bodies that need torch or the Delta tables import them in the run workers."""
    heavy = ("torch", "megatron", "transformers", "pyarrow", "deltalake", "numpy", "tokenizers")
    probe = (
        "import sys; import assets.definitions as d; "
        f"heavy = sorted(m for m in {heavy!r} if m in sys.modules); "
        "print(heavy, len(d.defs.resolve_asset_graph().get_all_asset_keys()))"
    )
    out = run(sys.executable, "-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[] "), out.stdout


def test_dagster_definitions_validate(tmp_path: Path) -> None:
    out = run(
        str(BIN / "dagster"),
        "definitions",
        "validate",
        "-w",
        "workspace.yaml",
        env={"DAGSTER_HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All code locations passed validation" in out.stdout + out.stderr
