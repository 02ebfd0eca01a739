"""The sensors' checks of run workers: a dead one (only for workers the default run launcher
started here), and a built-in explorer whose loop stopped beating."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.test_utils import instance_for_test

from assets.sensors import (
    busy_run,
    end_hung_explorer,
    evaluation_requests,
    explorer_request,
    lineage_check_request,
    worker_gone,
)
from resources.run_config import RunConfigResource
from trinity_dagster.handoff.heartbeat import (
    BUILTIN_EXPLORER_ID,
    Heartbeat,
    heartbeat_path,
    seconds_since_beat,
)
from trinity_dagster.handoff.trainer_state import write_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import tiny_config

ELSEWHERE = {"run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}}


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _started_run(
    instance: dg.DagsterInstance, pid: int, job_name: str = "train_job"
) -> dg.DagsterRun:
    """A STARTED run of `job_name` whose worker reported `pid`, as Dagster's run worker does."""
    run = dg.DagsterRun(job_name=job_name, run_id=f"run-{pid}", status=dg.DagsterRunStatus.STARTED)
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


def test_an_explorer_that_stopped_beating_is_ended_and_one_that_beats_is_not(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    _, config_file = tiny_config(tmp_path, {"explorer": {"step_timeout_s": 30}})
    run_config = RunConfigResource(config_path=str(config_file))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        run = _started_run(instance, worker.pid, job_name="rollouts_job")
        Heartbeat(run_config.paths, BUILTIN_EXPLORER_ID).beat(force=True)
        assert end_hung_explorer(instance, run_config) is None, "it beat just now"

        beat = heartbeat_path(run_config.paths, BUILTIN_EXPLORER_ID)
        old = time.time() - 31
        os.utime(beat, (old, old))  # a frozen generation or reward function
        skipped = explorer_request(instance, run_config)
        assert isinstance(skipped, dg.SkipReason), skipped
        assert "made no progress for 31 s (explorer.step_timeout_s 30)" in skipped.skip_message
        assert worker.wait(timeout=10) == -signal.SIGKILL
        ended = instance.get_run_by_id(run.run_id)
        assert ended is not None and ended.status == dg.DagsterRunStatus.FAILURE
    finally:
        worker.kill()
        worker.wait()


def test_the_heartbeat_beats_at_most_once_a_second_unless_forced(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    assert seconds_since_beat(paths, "e0") is None
    heartbeat = Heartbeat(paths, "e0")
    heartbeat.beat()
    first = heartbeat_path(paths, "e0").stat().st_mtime_ns
    time.sleep(0.01)
    heartbeat.beat()  # throttled: no write
    assert heartbeat_path(paths, "e0").stat().st_mtime_ns == first
    heartbeat.beat(force=True)
    assert heartbeat_path(paths, "e0").stat().st_mtime_ns > first
    since = seconds_since_beat(paths, "e0")
    assert since is not None and 0 <= since < 5


def test_an_explorer_run_killed_with_dagster_dev_does_not_hold_back_the_end_scores(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    # Its scores at the end of training fall to the sensor's runs once its worker is gone.
    _, config_file = tiny_config(tmp_path, {"trainer": {"total_steps": 2}})
    run_config = RunConfigResource(config_path=str(config_file))
    write_trainer_state(run_config.paths, "finished", 2, "trained all 2 steps")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        alive = _started_run(instance, worker.pid, job_name="rollouts_job")
        assert busy_run(instance, "rollouts_job") == alive
        for part in (evaluation_requests, lineage_check_request):
            waiting = part(instance, run_config)
            assert isinstance(waiting, dg.SkipReason), part
            assert f"rollouts_job run {alive.run_id}" in waiting.skip_message
        instance.report_run_failed(alive)
        _started_run(instance, _gone_pid(), job_name="rollouts_job")
        assert busy_run(instance, "rollouts_job") is None
        evaluations = evaluation_requests(instance, run_config)
        assert isinstance(evaluations, dg.SensorResult)
        # no weights were published here, so the final version is the initial one
        assert [(r.job_name, r.partition_key) for r in evaluations.run_requests] == [
            ("evaluation_job", "000000")
        ]
        check = lineage_check_request(instance, run_config)
        assert isinstance(check, dg.SensorResult)
        assert [r.job_name for r in check.run_requests] == ["lineage_check_job"]
    finally:
        worker.kill()
        worker.wait()
