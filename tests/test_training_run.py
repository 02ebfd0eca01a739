"""`trinity-dagster run` on an existing run root: what it keeps and what it lets go on, and
what it stops when it is stopped."""

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import psutil
import pytest

import trinity_dagster.commands.training_run as training_run
from tests.support.dagster_dev import REPO_ROOT, processes_with_env
from trinity_dagster.commands import daemon_control
from trinity_dagster.commands.code_server import CodeServers
from trinity_dagster.commands.daemon_control import (
    engine_processes,
    find_workspace,
    stop_run,
    stop_signals_raise,
)
from trinity_dagster.commands.errors import StoppedBySignal, TrainingRunError
from trinity_dagster.commands.run_summary import (
    accuracy_lines,
    held_out_accuracy,
    reward_line,
    rollout_reward_rise,
)
from trinity_dagster.commands.training_run import extend_finished_run
from trinity_dagster.config import load_config
from trinity_dagster.explorer.eval_versions import versions_to_evaluate
from trinity_dagster.graph_names import LOOP_SENSOR
from trinity_dagster.handoff.end_of_data import end_of_data, mark_end_of_data
from trinity_dagster.handoff.trainer_state import read_trainer_state, write_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.processes import AGENT_MODULE, RANK_MODULE
from trinity_dagster.service_api.state import read_state
from trinity_dagster.testing import tiny_config

# for `_watch`: no code server to watch
NO_SERVERS = CodeServers(workspace=Path("workspace.yaml"), sockets_dir=Path("sockets"))


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


def test_the_reward_rise_is_measured_over_25_steps_with_its_standard_error() -> None:
    rewards = [0.1, 0.2] * 50 + [0.3, 0.4] * 50  # 200 RL steps
    summary = rollout_reward_rise(rewards)
    assert summary["reward_window"] == 25
    assert summary["reward_first"] == pytest.approx(0.1 + 0.1 * 12 / 25)  # 13 x 0.1, 12 x 0.2
    assert summary["reward_last"] == pytest.approx(0.3 + 0.1 * 13 / 25)  # 12 x 0.3, 13 x 0.4
    # each window's variance is 0.0026: s.e. of the difference = sqrt(2 * 0.0026 / 25)
    assert summary["reward_rise_se"] == pytest.approx((2 * 0.0026 / 25) ** 0.5, rel=1e-3)
    assert reward_line(summary) == (
        "rollout reward: first 25 RL steps 0.148 -> last 25 0.352 (+0.204 ± 0.014 s.e.)"
    )
    short = rollout_reward_rise([0.25, 0.5, 0.3, 0.5, 0.6, 0.9, 0.75, 0.75])  # a quarter each
    assert (short["reward_window"], short["reward_first"], short["reward_last"]) == (2, 0.375, 0.75)
    single = rollout_reward_rise([0.1, 0.3])
    assert single["reward_rise_se"] is None
    assert reward_line(single) == "rollout reward: first 1 RL steps 0.100 -> last 1 0.300 (+0.200)"
    assert reward_line(rollout_reward_rise([])) == "rollout reward: no RL steps"


def test_the_sft_models_weights_are_evaluated_while_they_are_on_disk(tmp_path: Path) -> None:
    config = load_config(None, {"run_root": str(tmp_path / "run"), "trainer.sft_warmup_steps": 4})
    paths = RunPaths.of_config(config)
    assert versions_to_evaluate(config, paths, 10) == [0, 10]  # no weights of step 4 on disk

    exported = paths.checkpoints / "global_step_4" / "huggingface"
    exported.mkdir(parents=True)
    (exported / "config.json").write_text("{}")
    assert versions_to_evaluate(config, paths, 10) == [0, 4, 10]
    assert versions_to_evaluate(config, paths, 4) == [0, 4]  # all warm-up: 4 is the final


SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
CODE_SERVER = (
    "import subprocess, sys, time; "
    "worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
    "print(worker.pid, flush=True); time.sleep(600)"
)


def started(command: list[str]) -> subprocess.Popen:
    """`command` in a session of its own, as a code server and the engine service start."""
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, text=True)


def fake_engine(paths: RunPaths, module: str) -> subprocess.Popen:
    """A process whose command line is that of the engine agent or a rank of `paths`'s run
    root, before any state file exists (a service still starting)."""
    config_file = str(paths.service_config)
    script = "import time; time.sleep(600)"
    return started([sys.executable, "-c", script, "-m", module, "-c", config_file])


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class StoppingDaemon:
    """Stands for the daemon: records whether the code server got SIGTERM before its stop."""

    def __init__(self, server: subprocess.Popen) -> None:
        self.server = server
        self.server_signalled_first: bool | None = None

    def stop(self) -> None:
        self.server_signalled_first = self.server.wait(timeout=10) == -signal.SIGTERM


def test_stopping_a_run_ends_its_workers_the_daemon_and_an_engine_still_starting(
    tmp_path: Path,
) -> None:
    paths = RunPaths.of(tmp_path / "run")
    other = RunPaths.of(tmp_path / "other")
    server = started([sys.executable, "-c", CODE_SERVER, SLEEPER])  # its worker ignores SIGTERM
    assert server.stdout is not None
    worker = int(server.stdout.readline())
    daemon = StoppingDaemon(server)
    engine = [fake_engine(paths, AGENT_MODULE), fake_engine(paths, RANK_MODULE)]
    unrelated = fake_engine(other, AGENT_MODULE)
    try:
        deadline = time.monotonic() + 30
        while len(engine_processes(paths)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(p.pid for p in engine_processes(paths)) == sorted(p.pid for p in engine)
        assert read_state(paths) is None  # still starting: no state file names it

        stop_run(daemon, [server], paths)  # type: ignore[arg-type]

        # the workers get SIGTERM, then the daemon's stop to end, then SIGKILL
        assert daemon.server_signalled_first and gone(worker)
        for process in engine:
            process.wait(timeout=10)
        assert unrelated.poll() is None  # another run root's engine is left alone
    finally:
        for process in (server, *engine, unrelated):
            process.kill()
            process.wait()


STOP_MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def ignored_mask(script: str) -> str:
    """The SigIgn mask (hex) that `script`, run by bash, prints from /proc."""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.split("SigIgn:")[1].split()[0]


CHILD_SIGNALS = (
    "import subprocess; from trinity_dagster.commands.daemon_control import restore_stop_signals; "
    "restore_stop_signals(); "
    "print(subprocess.run(['grep', 'SigIgn', '/proc/self/status'], capture_output=True, "
    "text=True).stdout)"
)


def test_processes_started_by_a_command_stop_even_when_its_shell_ignored_the_signals() -> None:
    ignored = int("0x" + ignored_mask("trap '' INT TERM; grep SigIgn /proc/self/status"), 16)
    assert ignored & STOP_MASK == STOP_MASK  # the shell's own children inherit both

    child = ignored_mask(f"trap '' INT TERM; {sys.executable} -c \"{CHILD_SIGNALS}\"")
    assert int("0x" + child, 16) & STOP_MASK == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_raises_once_and_the_old_handlers_come_back(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    with stop_signals_raise():
        with pytest.raises(StoppedBySignal) as err:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises here
        os.kill(os.getpid(), sig)  # a second one, while the command cleans up: ignored
    assert err.value.exit_code == 128 + sig
    assert str(err.value) == f"stopped by {sig.name}: daemon, runs and engine stopped"
    assert signal.getsignal(sig) == before


def wait_until(what: str, ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll `ready` until it is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class StoppedRun:
    """`trinity-dagster run` of a tiny config in a subprocess, to be stopped by a signal."""

    def __init__(self, tmp_path: Path, extra: dict | None = None) -> None:
        config, config_file = tiny_config(tmp_path, extra)
        self.paths = RunPaths.of_config(config)
        command = [str(Path(sys.executable).parent / "trinity-dagster"), "run", "-c"]
        self.process = subprocess.Popen(
            [*command, str(config_file)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def started(self) -> list[int]:
        """Pids of what the command started (they all have the run's DAGSTER_HOME)."""
        return processes_with_env("DAGSTER_HOME", str(self.paths.dagster_home))

    def stop(self, sig: signal.Signals) -> str:
        """Send `sig`; the command's stderr once it exited, with the status it should have."""
        self.process.send_signal(sig)
        _, stderr = self.process.communicate(timeout=300)
        assert self.process.returncode == 128 + sig, stderr
        return stderr

    def kill_leftovers(self) -> None:
        """SIGKILL the command and whatever it left running (after a failed check)."""
        self.process.kill()
        self.process.communicate()
        for pid in self.started():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_the_daemon_and_prints_one_line(tmp_path: Path) -> None:
    run = StoppedRun(tmp_path)
    try:
        wait_until("the code server", lambda: bool(run.started()), timeout_s=120)
        stderr = run.stop(signal.SIGINT)
        assert stderr == "trinity-dagster: stopped by SIGINT: daemon, runs and engine stopped\n"
        assert run.started() == []
    finally:
        run.kill_leftovers()


@pytest.mark.slow
def test_sigterm_stops_the_runs_and_an_engine_still_starting(tmp_path: Path) -> None:
    run = StoppedRun(tmp_path)
    try:
        wait_until("the engine service", lambda: bool(engine_processes(run.paths)), 300)
        assert read_state(run.paths) is None  # still starting
        stderr = run.stop(signal.SIGTERM)
        assert stderr == "trinity-dagster: stopped by SIGTERM: daemon, runs and engine stopped\n"
        assert run.started() == []
        time.sleep(5)  # nothing comes up late
        assert run.started() == [] and engine_processes(run.paths) == []
    finally:
        run.kill_leftovers()


def test_a_run_stopped_while_it_trains_runs_the_daemon_itself_and_stops_everything(
    tmp_path: Path,
) -> None:
    run = StoppedRun(tmp_path, {"trainer": {"total_steps": 400}})
    try:
        assert run.process.stdout is not None
        for line in run.process.stdout:
            if line.startswith("[  3/400] train"):
                break
        # the daemon's threads are the command's: none of the processes it started is one
        commands = [" ".join(psutil.Process(pid).cmdline()) for pid in run.started()]
        assert commands and not any("daemon" in command for command in commands), commands
        with dg.DagsterInstance.from_config(str(run.paths.dagster_home)) as instance:
            beating = set(instance.get_daemon_heartbeats())
        assert {"SENSOR", "QUEUED_RUN_COORDINATOR", "MONITORING"} <= beating

        stderr = run.stop(signal.SIGINT)

        assert stderr == "trinity-dagster: stopped by SIGINT: daemon, runs and engine stopped\n"
        assert run.started() == [] and engine_processes(run.paths) == []
        daemon_log = run.paths.daemon_log.read_text()
        assert "Checking for new runs for sensor" in daemon_log
        assert "Daemon threads shut down." in daemon_log
    finally:
        run.kill_leftovers()


class _QuietProgress:
    """A `Progress` with nothing new: no lines, no failure, every evaluation and the lineage
    check recorded."""

    def __init__(self, config) -> None:
        self.config = config

    def new_lines(self) -> list[str]:
        return []

    def final_failure(self) -> None:
        return None

    def sensor_failure(self) -> None:
        return None

    def evaluation(self, version: int) -> dict:
        return {"eval/accuracy": 0.5}

    def lineage_check(self, since: float) -> dict:
        return {"passed": True}

    def run_going(self, job_name: str) -> bool:
        return False


def test_run_says_once_that_training_is_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = tiny_config(tmp_path, {"trainer": {"total_steps": 4}})
    paths = RunPaths.of_config(config)
    monkeypatch.setattr(training_run, "PROGRESS_POLL_S", 0.05)
    write_trainer_state(paths, "paused", 2, "paused by request r1.pause.now at step 2")
    polls = {"n": 0}

    class Daemon:
        def check(self) -> None:
            polls["n"] += 1
            if polls["n"] == 5:  # the user resumed, and training went on to its end
                write_trainer_state(paths, "finished", 4, "trained all 4 steps")

    training_run._watch(_QuietProgress(config), Daemon(), NO_SERVERS, paths)  # type: ignore[arg-type]
    lines = [line for line in capsys.readouterr().out.splitlines() if "paused" in line]
    assert lines == [
        "trinity-dagster: training is paused at step 2 (paused by request r1.pause.now at "
        "step 2); launch resume_training in the UI to go on"
    ]


def test_a_stop_signal_whose_raise_was_lost_is_raised_by_the_watch_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a signal handled inside a garbage-collector callback: Python drops the handler's raise
    config, _ = tiny_config(tmp_path, {"trainer": {"total_steps": 4}})
    monkeypatch.setattr(training_run, "PROGRESS_POLL_S", 0.05)

    class Collected:
        pass

    paths = RunPaths.of_config(config)

    class Daemon:
        def check(self) -> None:  # without the stop, training ends normally
            write_trainer_state(paths, "finished", 4, "trained all 4 steps")

    # Python reports a dropped raise ("Exception ignored in ...", on stderr) through
    # sys.unraisablehook; the command's one line must not come after such a traceback
    reported: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    with stop_signals_raise():
        thing = Collected()
        weakref.finalize(thing, daemon_control._raise_stopped, signal.SIGTERM, None)
        del thing
        with pytest.raises(StoppedBySignal) as stopped:
            training_run._watch(_QuietProgress(config), Daemon(), NO_SERVERS, paths)  # type: ignore[arg-type]
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert reported == []


def test_a_stop_signal_a_library_wrapped_still_stops_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLAlchemy wraps an exception raised inside a query into its StatementError
    config, _ = tiny_config(tmp_path, {"trainer": {"total_steps": 4}})

    def train(config, workspace_file) -> None:
        try:
            daemon_control._raise_stopped(signal.SIGINT, None)
        except StoppedBySignal as err:
            raise RuntimeError("(builtins.StoppedBySignal) while executing a query") from err

    monkeypatch.setattr(training_run, "_train", train)
    with pytest.raises(StoppedBySignal) as stopped:
        training_run.run_training(config, REPO_ROOT / "workspace.yaml")
    assert stopped.value.exit_code == 128 + signal.SIGINT


def test_a_stop_signal_during_a_launch_is_raised_once_the_launch_is_recorded() -> None:
    launched: list[str] = []
    with stop_signals_raise():
        with pytest.raises(StoppedBySignal) as stopped, daemon_control.stop_signals_deferred():
            daemon_control._raise_stopped(signal.SIGTERM, None)  # inside Popen, say
            launched.append("daemon")
        assert launched == ["daemon"]  # the clean-up knows what to stop
    assert stopped.value.exit_code == 128 + signal.SIGTERM


def _sensor_tick(instance, status: str, failures: int, error: str = "ValueError") -> None:
    """A tick of `rft_loop_sensor` as the daemon records it (its state added if new)."""
    from dagster._core.remote_origin import (
        GrpcServerCodeLocationOrigin,
        RemoteInstigatorOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.scheduler.instigation import (
        InstigatorState,
        InstigatorStatus,
        InstigatorType,
        TickData,
        TickStatus,
    )
    from dagster._utils.error import SerializableErrorInfo

    location = GrpcServerCodeLocationOrigin(host="127.0.0.1", port=1, location_name="loc")
    origin = RemoteInstigatorOrigin(RemoteRepositoryOrigin(location, "__repository__"), LOOP_SENSOR)
    state = InstigatorState(origin, InstigatorType.SENSOR, InstigatorStatus.RUNNING)
    if not instance.all_instigator_state():
        instance.add_instigator_state(state)
    failed = status == "failure"
    instance.create_tick(
        TickData(
            instigator_origin_id=state.instigator_origin_id,
            instigator_name=LOOP_SENSOR,
            instigator_type=InstigatorType.SENSOR,
            status=TickStatus.FAILURE if failed else TickStatus.SKIPPED,
            timestamp=time.time(),
            error=SerializableErrorInfo("the sensor broke", [], error) if failed else None,
            consecutive_failure_count=failures,
            selector_id=state.selector_id,
        )
    )


def test_the_sensor_counts_as_failed_after_its_third_failed_tick_in_a_row(tmp_path: Path) -> None:
    import dagster as dg

    from trinity_dagster.commands.instance_progress import Progress

    config, _ = tiny_config(tmp_path)
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        progress = Progress(instance, config)
        assert progress.sensor_failure() is None  # no sensor yet
        _sensor_tick(instance, "failure", 2)
        assert progress.sensor_failure() is None
        _sensor_tick(instance, "failure", 3, error="DagsterUserCodeUnreachableError")
        assert progress.sensor_failure() is None  # the daemon retries an unreachable server
        _sensor_tick(instance, "failure", 3)
        failure = progress.sensor_failure()
        assert failure is not None
        assert failure.startswith(f"{LOOP_SENSOR} failed 3 ticks in a row: the sensor broke")
        _sensor_tick(instance, "skipped", 0)
        assert progress.sensor_failure() is None


def test_a_failure_ends_the_watch_and_failures_are_read_every_few_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = tiny_config(tmp_path, {"trainer": {"total_steps": 4}})
    paths = RunPaths.of_config(config)
    monkeypatch.setattr(training_run, "PROGRESS_POLL_S", 0.05)
    monkeypatch.setattr(training_run, "FAILURE_POLL_S", 0.5)
    reads: list[float] = []

    class Failing(_QuietProgress):
        def final_failure(self) -> str | None:
            reads.append(time.monotonic())
            return "train run r1 failed: boom" if len(reads) == 3 else None

    class Daemon:
        def check(self) -> None:
            return None

    with pytest.raises(TrainingRunError, match="train run r1 failed: boom"):
        training_run._watch(Failing(config), Daemon(), NO_SERVERS, paths)  # type: ignore[arg-type]
    assert all(b - a >= 0.5 for a, b in itertools.pairwise(reads)), reads  # not at every poll
