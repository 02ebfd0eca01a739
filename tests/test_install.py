"""The package installed from its wheel (not editable) trains from outside the repository.

The project is built and installed with pip into a target directory of its own, from a copy of
the sources; the commands run with that directory first on `PYTHONPATH` (this environment's
editable install only answers imports that nothing on the path can), from a directory outside
the repository, with the repository's `workspace.yaml` given: the code location (`assets/`,
`resources/`) stays in the repository, the library and the CLI come from the install.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.dagster_dev import processes_with_env
from trinity_dagster.checkpoint.layout import checkpoint_dir, latest_checkpoint_step
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.testing import TINY, merge

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TOTAL_STEPS = 2
SETTINGS = {
    "trainer": {"total_steps": TOTAL_STEPS, "save_interval": 2, "sft_warmup_steps": 0},
    "explorer": {"tasks_per_step": 2, "eval_tasks": 8},
}
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install` (not editable, no network) of a copy of the sources; the target dir."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    shutil.copytree(
        REPO / "trinity_dagster",
        source / "trinity_dagster",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    target = root / "installed"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    pip += ["--no-deps", "--no-build-isolation", "--no-index", "--target", str(target)]
    done = subprocess.run([*pip, str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return target


def installed_env(target: Path) -> dict[str, str]:
    """This environment with the installed package first on the path and no run settings."""
    unset = ("DAGSTER_HOME", "TRINITY_DAGSTER_CONFIG", "PYTHONPATH")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    return {**env, "PYTHONPATH": str(target)}


def write_config(directory: Path) -> Path:
    """A tiny run of `TOTAL_STEPS` GRPO steps rooted under `directory`."""
    file = directory / "config.yaml"
    data = merge(TINY, {**SETTINGS, "run_root": str(directory / "run")})
    file.write_text(yaml.safe_dump(data))
    return file


def stop_leftovers(paths: RunPaths) -> None:
    """Stop the run's engine service and any process still on its Dagster instance."""
    stop_service(paths)
    for pid in processes_with_env("DAGSTER_HOME", str(paths.dagster_home)):
        os.kill(pid, signal.SIGKILL)


def test_installed_package_trains_from_outside_the_repo(installed: Path, tmp_path: Path) -> None:
    env = installed_env(installed)
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    where = subprocess.run(
        [sys.executable, "-c", "import trinity_dagster; print(trinity_dagster.__file__)"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(installed), where
    assert not Path(where).is_relative_to(REPO), where

    config_file = write_config(outside)
    paths = RunPaths.of(outside / "run")
    command = [str(installed / "bin" / "trinity-dagster"), "run", "-c", str(config_file)]
    command += ["--workspace", str(REPO / "workspace.yaml")]
    try:
        done = subprocess.run(
            command, cwd=outside, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    finally:
        stop_leftovers(paths)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = json.loads((paths.root / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS, summary
    assert latest_checkpoint_step(paths) == TOTAL_STEPS
    verify_checkpoint(checkpoint_dir(paths, TOTAL_STEPS), checksums=True)
    assert summary["hf_model"] is not None, summary


def test_installed_bench_runs_the_benchmarks_of_the_given_checkout(
    installed: Path, tmp_path: Path
) -> None:
    bench = [str(installed / "bin" / "trinity-dagster"), "bench"]
    env = installed_env(installed)

    found = subprocess.run(
        [*bench, "--repo", str(REPO), "buffer", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-3000:]
    assert "--pins" in found.stdout

    missing = subprocess.run(
        [*bench, "buffer"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2
    assert f"no benchmarks/ in {tmp_path.resolve()}" in missing.stderr
    assert "--repo" in missing.stderr
