"""The owner of an engine service: found among a run worker's ancestors, claimed by the
deployment that starts or attaches to the service, and told from a process that reused its
pid or runs on another host."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import pytest

from trinity_dagster.paths import RunPaths
from trinity_dagster.service import launcher
from trinity_dagster.service.owner import (
    Owner,
    claim,
    current_owner,
    dagster_deployment,
    orphaned,
    owner_report,
    runs_dagster,
    this_process,
)
from trinity_dagster.service_api.state import ServiceState
from trinity_dagster.testing import tiny_config

PYTHON = sys.executable


@pytest.mark.parametrize(
    ("cmdline", "dagster"),
    [
        ([PYTHON, "/venv/bin/dagster", "dev", "-w", "workspace.yaml"], True),
        (["/venv/bin/dagster-daemon", "run", "-w", "workspace.yaml"], True),
        ([PYTHON, "-m", "dagster", "code-server", "start"], True),
        ([PYTHON, "-m", "dagster", "api", "execute_run", "{}"], True),
        ([PYTHON, "-m", "dagster._daemon", "run"], True),
        ([PYTHON, "-m", "dagster_webserver", "--port", "3000"], True),
        ([PYTHON, "/venv/bin/trinity-dagster", "run", "-c", "dagster"], False),
        ([PYTHON, "-m", "pytest", "tests/dagster"], False),
        (["bash", "-c", "sleep 1", "dagster"], False),
        ([], False),
    ],
)
def test_dagster_processes_are_told_by_their_first_words(cmdline: list[str], dagster: bool) -> None:
    assert runs_dagster(cmdline) is dagster


def _run_as(name: str, script: Path) -> list[str]:
    """The command that runs `script` with `name` as its argv[0], as a console script's."""
    return ["bash", "-c", f'exec -a {name} "{PYTHON}" "{script}"']


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[list[psutil.Process]]:
    """Processes started by this one, top down: `dagster` (as `dagster dev`) ->
    `dagster-daemon` -> `dagster` (a run worker) -> plain `python` (a step's worker that
    Dagster started with multiprocessing), the last one waiting."""
    pid_file = tmp_path / "step.pid"
    scripts = {
        "step": f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n",
        # sys.executable is unknown under another argv[0]
        "worker": "import subprocess\n"
        f"subprocess.run([{PYTHON!r}, {str(tmp_path / 'step.py')!r}])\n",
        "daemon": "import subprocess\n"
        f"subprocess.run({_run_as('dagster', tmp_path / 'worker.py')!r})\n",
        "top": "import subprocess\n"
        f"subprocess.run({_run_as('dagster-daemon', tmp_path / 'daemon.py')!r})\n",
    }
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(text)
    top = subprocess.Popen(_run_as("dagster", tmp_path / "top.py"))
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the process chain did not start"
            time.sleep(0.05)
        step = psutil.Process(int(pid_file.read_text()))
        yield [*reversed(step.parents()[:3]), step]
    finally:
        for process in psutil.Process(top.pid).children(recursive=True):
            process.kill()
        top.kill()
        top.wait()


def test_the_owner_is_the_outermost_dagster_process_above_a_step(
    chain: list[psutil.Process],
) -> None:
    top = chain[0]
    assert top.parent() == psutil.Process()
    assert [runs_dagster(p.cmdline()) for p in chain] == [True, True, True, False]
    for process in chain:
        assert dagster_deployment(process) == Owner.of(top), process.cmdline()


def test_a_process_outside_dagster_has_no_owner() -> None:
    assert dagster_deployment() is None  # pytest, as `dagster.materialize` in a script


def test_the_last_claim_owns_the_service_and_a_dead_owner_orphans_it(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    assert current_owner(paths) is None and not orphaned(paths)
    process = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        owner = Owner.of(psutil.Process(process.pid))
        claim(paths, this_process())
        claim(paths, owner)  # a later deployment attaches: it owns the service now
        assert current_owner(paths) == owner and owner.alive() and not orphaned(paths)
        assert owner_report(paths) == {
            "pid": process.pid,
            "started_at": owner.started_at,
            "host": owner.host,
            "alive": True,
        }
    finally:
        process.kill()
        process.wait()
    assert not owner.alive() and orphaned(paths)
    assert owner_report(paths) == {**asdict(owner), "alive": False}
    claim(paths, None)
    assert current_owner(paths) is None and not orphaned(paths) and owner_report(paths) is None


def test_a_process_that_reused_the_owners_pid_is_not_the_owner() -> None:
    me = this_process()
    assert me.alive()
    assert not replace(me, started_at=me.started_at - 10).alive()


def test_an_owner_on_another_host_or_an_unreadable_claim_is_no_owner(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    elsewhere = replace(this_process(), host="another-node")
    claim(paths, elsewhere)
    assert current_owner(paths) is None and not orphaned(paths)
    assert owner_report(paths) == {**asdict(elsewhere), "alive": None}  # cannot be seen
    for text in ("{not json", "[]", '{"pid": "x", "started_at": 1, "host": "h"}', "{}"):
        paths.service_owner.write_text(text)
        assert current_owner(paths) is None and owner_report(paths) is None, text


def test_a_deployment_that_attaches_to_a_running_service_claims_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = tiny_config(tmp_path)
    paths = RunPaths.of_config(config)
    running = ServiceState(
        pid=1, pgid=1, launcher_pid=1, host="127.0.0.1", port=1, world_size=1,
        config_hash=config.resolved_hash(), log_file="engine.log",
    )  # fmt: skip
    monkeypatch.setattr(launcher, "live_service", lambda _: running)
    first = this_process()
    assert launcher.start_service(config, owner=first) == running
    assert current_owner(paths) == first
    assert launcher.start_service(config) == running  # no owner of its own: the claim stays
    assert current_owner(paths) == first
