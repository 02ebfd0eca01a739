"""The sensors' dead-worker check: only for workers the default run launcher started here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
from dagster._core.test_utils import instance_for_test

from assets.sensors import worker_gone

ELSEWHERE = {"run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}}


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _started_run(instance: dg.DagsterInstance, pid: int) -> dg.DagsterRun:
    """A STARTED run whose worker reported `pid`, as Dagster's run worker does."""
    run = dg.DagsterRun(
        job_name="train_job", run_id=f"run-{pid}", status=dg.DagsterRunStatus.STARTED
    )
    instance.add_run(run)
    instance.report_engine_event(f"Started process for run (pid: {pid}).", run)
    return run


@pytest.fixture
def instance(request: pytest.FixtureRequest) -> Iterator[dg.DagsterInstance]:
    overrides: dict[str, Any] | None = getattr(request, "param", None)
    with instance_for_test(overrides=overrides) as found:
        yield found


def test_a_local_worker_that_is_gone_is_reported(instance: dg.DagsterInstance) -> None:
    pid = _gone_pid()
    assert worker_gone(instance, _started_run(instance, pid)) == pid


@pytest.mark.parametrize("instance", [ELSEWHERE], indirect=True)
def test_a_worker_started_by_another_launcher_is_left_to_run_monitoring(
    instance: dg.DagsterInstance,
) -> None:
    # Kubernetes or Docker workers run elsewhere: their pid means nothing on this machine.
    assert worker_gone(instance, _started_run(instance, _gone_pid())) is None
