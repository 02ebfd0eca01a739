"""A whole training run driven by the Dagster daemon, for `trinity-dagster demo` and `run`.

The command prepares the run's Dagster instance under `run_root/dagster_home` (the settings
of `trinity_dagster.dagster_instance`), starts `dagster-daemon run` headless on the
workspace, and watches the instance: the daemon's sensors start the trainer and explorer
loops and the evaluations, exactly as under `dagster dev`. It prints one line per recorded
explore and train step, fails with the cause when a run fails for good, and ends when the
trainer finished, the final weights are evaluated and `trained_exactly_once` has checked the
run's lineage (a failed check fails the command). `dagster dev` on the same instance
shows the whole history afterwards. SIGINT or SIGTERM stops the daemon, its run workers and
the run root's engine service (also one still starting) before the command exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import fmean, variance
from typing import TYPE_CHECKING, Any

from trinity_dagster.commands.errors import StoppedBySignal, TrainingRunError
from trinity_dagster.config import CONFIG_ENV_VAR, TrinityConfig, check_inputs, start_fresh
from trinity_dagster.dagster_instance import WILL_RETRY_TAG, write_instance_yaml
from trinity_dagster.graph_names import (
    EVALUATION,
    LOOP_SENSOR,
    ROLLOUTS,
    TRAIN,
    TRAINED_EXACTLY_ONCE,
)
from trinity_dagster.handoff.end_of_data import clear_end_of_data
from trinity_dagster.handoff.trainer_state import read_trainer_state, state_path
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key

if TYPE_CHECKING:
    import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRESS_POLL_S = 1.0
FAILURE_REASON = "dagster/failure_reason"
FAILED_TICKS = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals() -> None:
    """From here on SIGINT and SIGTERM do nothing (so that they cannot cut a cleanup short)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


# The stop signal received within `stop_signals_raise`: Python ignores an exception raised in
# a garbage-collector callback, so a handler's raise can be lost, and the watch loop raises it.
_received: list[int] = []


def _raise_stopped(signum: int, frame: Any) -> None:
    """The handler of SIGINT and SIGTERM within `stop_signals_raise`."""
    ignore_stop_signals()
    _received.append(signum)
    raise StoppedBySignal(signum)


def raise_if_stopped() -> None:
    """Raise `StoppedBySignal` for a stop signal received whose handler's raise was lost."""
    if _received:
        raise StoppedBySignal(_received[0])


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within: the first SIGINT or SIGTERM raises `StoppedBySignal`, later ones are ignored;
    the handlers from before come back at the end."""
    _received.clear()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()


def metadata_values(event: Any) -> dict[str, Any]:
    """The metadata of a Dagster materialization or observation as plain values by name."""
    return {name: entry.value for name, entry in event.metadata.items()}


def find_workspace(workspace: str | Path | None) -> Path:
    """The `workspace.yaml` that loads the code location (given, in the cwd, or the repo's)."""
    candidates = [Path(workspace)] if workspace else [Path.cwd() / "workspace.yaml"]
    if workspace is None:
        candidates.append(REPO_ROOT / "workspace.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise TrainingRunError(
        f"no Dagster workspace at {', '.join(str(c) for c in candidates)}: run from the "
        "trinity-dagster repository root or pass --workspace PATH/workspace.yaml"
    )


def prepare_instance(config: TrinityConfig) -> Path:
    """Write the run's config and instance settings; point this process's Dagster at them."""
    paths = RunPaths.of_config(config)
    paths.root.mkdir(parents=True, exist_ok=True)
    config_file = paths.root / "config.yaml"
    config_file.write_text(config.to_yaml())
    write_instance_yaml(paths.dagster_home, config.dagster.postgres_url, replace=True)
    os.environ[CONFIG_ENV_VAR] = str(config_file)
    os.environ["DAGSTER_HOME"] = str(paths.dagster_home)
    return config_file


def extend_finished_run(paths: RunPaths, total_steps: int | None) -> bool:
    """Let a run that stopped before `total_steps` go on: forget its end (state, data end).

    Returns whether there was such an end. A run that reached `total_steps` stays finished,
    and so does one without `total_steps`, which ends only when its data does.
    """
    state = read_trainer_state(paths)
    if total_steps is None or state is None or state.state != "finished":
        return False
    if state.step >= total_steps:
        return False
    clear_end_of_data(paths)
    state_path(paths).unlink()
    return True


def dagster_dev_command(config: TrinityConfig, config_file: Path, workspace: Path) -> str:
    """The command that opens this run's instance in the Dagster UI."""
    paths = RunPaths.of_config(config)
    return (
        f"cd {workspace.parent} && DAGSTER_HOME={paths.dagster_home} "
        f"{CONFIG_ENV_VAR}={config_file} {Path(sys.executable).parent / 'dagster'} dev "
        f"-w {workspace.name} -h 127.0.0.1 -p 3000"
    )


def start_daemon(paths: RunPaths, workspace: Path) -> subprocess.Popen:
    """`dagster-daemon run` on the workspace, in its own session, logging under `logs/`."""
    paths.logs.mkdir(parents=True, exist_ok=True)
    log = open(paths.logs / "dagster-daemon.log", "ab")  # noqa: SIM115 (owned by the child)
    command = [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(workspace)]
    return subprocess.Popen(
        command,
        cwd=workspace.parent,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=os.environ.copy(),
    )


def stop_daemon(daemon: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop the daemon and everything it started (code server, run workers)."""
    if daemon.poll() is None:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(daemon.pid, signal.SIGKILL)  # run workers left in the session


def engine_processes(paths: RunPaths) -> list[psutil.Process]:
    """The engine service agents and ranks on this machine started for this run root, found
    by the config file on their command line (one still starting has no state file yet)."""
    import psutil

    from trinity_dagster.service.processes import AGENT_MODULE, RANK_MODULE
    from trinity_dagster.service_api.state import CONFIG_FILE

    config_file = str(paths.service / CONFIG_FILE)
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if config_file in cmdline and not {AGENT_MODULE, RANK_MODULE}.isdisjoint(cmdline):
            found.append(process)
    return found


def stop_run(daemon: subprocess.Popen, paths: RunPaths) -> None:
    """Stop what a training run started: the daemon with its run workers, then the run
    root's engine service, cleanly if it answers, and any of its processes left here."""
    from trinity_dagster.service.launcher import STOP_GRACE_S, stop_service
    from trinity_dagster.service.processes import end_processes

    stop_daemon(daemon)
    stop_service(paths)
    end_processes(engine_processes(paths), grace_s=STOP_GRACE_S)


class Progress:
    """Reads the instance: new step materialisations, final failures, the end of training."""

    def __init__(self, instance: Any, config: TrinityConfig) -> None:
        import dagster as dg

        self.dg = dg
        self.instance = instance
        self.config = config
        self.paths = RunPaths.of_config(config)
        self.cursors: dict[str, str | None] = {ROLLOUTS: None, TRAIN: None}
        self.reported_failures: set[str] = set()
        self.reported_retries: set[str] = set()

    def new_lines(self) -> list[str]:
        """One line per explore or train step recorded since the last call, and per run
        that failed and is retried."""
        lines = []
        for asset in self.cursors:
            result = self.instance.fetch_materializations(
                self.dg.AssetKey(asset), limit=1000, cursor=self.cursors[asset], ascending=True
            )
            if result.records:
                self.cursors[asset] = result.cursor
            for record in result.records:
                event = record.asset_materialization
                if event is not None and event.partition is not None:
                    meta = metadata_values(event)
                    lines.append(self._line(asset, int(event.partition), meta))
        return lines + self._retried_runs()

    def _retried_runs(self) -> list[str]:
        """One line per run that failed and that Dagster's run retries start again."""
        dg = self.dg
        failed = self.instance.get_runs(
            filters=dg.RunsFilter(
                statuses=[dg.DagsterRunStatus.FAILURE], tags={WILL_RETRY_TAG: "true"}
            )
        )
        lines = []
        for run in failed:
            if run.run_id not in self.reported_retries:
                self.reported_retries.add(run.run_id)
                error = self._error(run.run_id)
                lines.append(f"{run.job_name} run {run.run_id} failed and is retried: {error}")
        return lines

    def _line(self, asset: str, step: int, meta: dict[str, Any]) -> str:
        head = f"[{step:>3}/{self.config.trainer.total_steps or '?'}]"
        if asset == ROLLOUTS:
            kind = "demonstrations" if meta.get("demonstrations") else "rollouts"
            return (
                f"{head} explore  {kind}: reward {meta.get('reward_mean', float('nan')):.3f}, "
                f"weights v{meta.get('weights_version')}"
            )
        return (
            f"{head} train    pg_loss {meta.get('actor/pg_loss', float('nan')):+.4f}, "
            f"entropy {meta.get('actor/entropy', float('nan')):.3f}, "
            f"reward {meta.get('critic/rewards/mean', float('nan')):.3f}, "
            f"{meta.get('time/step', float('nan')):.2f}s"
        )

    def sensor_failure(self) -> str | None:
        """The error of the loop's sensor once `FAILED_TICKS` of its ticks failed in a row.

        A sensor that raises on every tick would otherwise leave the run waiting forever; a
        code server that is not reachable yet (the daemon retries it) does not count.
        """
        for state in self.instance.all_instigator_state():
            if state.instigator_name != LOOP_SENSOR:
                continue
            ticks = self.instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
            tick = ticks[0] if ticks else None
            if tick is None or not tick.is_failure or tick.error is None:
                continue
            if tick.error.cls_name == "DagsterUserCodeUnreachableError":
                continue
            if tick.consecutive_failure_count >= FAILED_TICKS:
                return (
                    f"{LOOP_SENSOR} failed {tick.consecutive_failure_count} ticks in a row: "
                    f"{tick.error.to_string()}"
                )
        return None

    def final_failure(self) -> str | None:
        """The error of a run that failed and will not be retried, if any."""
        dg = self.dg
        failed = self.instance.get_runs(
            filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE])
        )
        for run in failed:
            if run.run_id in self.reported_failures:
                continue
            step_failure = run.tags.get(FAILURE_REASON) == "STEP_FAILURE"
            if not step_failure and run.tags.get(WILL_RETRY_TAG) != "false":
                continue  # retried by the daemon, or not decided yet
            self.reported_failures.add(run.run_id)
            return f"{run.job_name} run {run.run_id} failed: {self._error(run.run_id)}"
        return None

    def _error(self, run_id: str) -> str:
        dg = self.dg
        for kind in (dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE):
            records = self.instance.get_records_for_run(run_id, of_type=kind).records
            for record in records:
                event = record.event_log_entry.dagster_event
                error = getattr(event.event_specific_data, "error", None)
                if error is not None:
                    return error.to_string()
                if event.message:
                    return event.message
        return "no error recorded (see the run's logs)"

    def evaluation(self, version: int) -> dict[str, Any] | None:
        """The metadata of `evaluation[version]`, once recorded."""
        dg = self.dg
        key = step_key(version)
        records = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(EVALUATION), asset_partitions=[key]),
            limit=1,
        ).records
        if not records or records[0].asset_materialization is None:
            return None
        return metadata_values(records[0].asset_materialization)

    def lineage_check(self, since: float) -> dict[str, Any] | None:
        """`passed` and the metadata of the newest `trained_exactly_once` evaluation made
        after `since` (a time), once there is one."""
        dg = self.dg
        key = dg.AssetCheckKey(dg.AssetKey(TRAIN), TRAINED_EXACTLY_ONCE)
        found = self.instance.event_log_storage.get_latest_asset_check_execution_by_key([key])
        record = found.get(key)
        if record is None or record.create_timestamp < since or record.event is None:
            return None
        evaluation = record.event.dagster_event.event_specific_data
        if not isinstance(evaluation, dg.AssetCheckEvaluation):
            return None  # planned, not evaluated yet
        return {"passed": evaluation.passed, **metadata_values(evaluation)}

    def rollout_rewards(self) -> list[tuple[int, float, bool]]:
        """(explore step, mean reward, demonstrations?) of every rollouts partition, by step."""
        records = self.instance.fetch_materializations(
            self.dg.AssetKey(ROLLOUTS), limit=10_000
        ).records
        latest: dict[int, tuple[float, bool]] = {}
        for record in sorted(records, key=lambda r: r.storage_id):
            event = record.asset_materialization
            if event is None or event.partition is None:
                continue
            meta = metadata_values(event)
            latest[int(event.partition)] = (
                float(meta["reward_mean"]),
                bool(meta["demonstrations"]),
            )
        return [(step, reward, demo) for step, (reward, demo) in sorted(latest.items())]


def run_training(config: TrinityConfig, workspace: str | Path | None = None) -> dict[str, Any]:
    """Train to the end through the Dagster daemon; write and return `summary.json`.

    Raises `StoppedBySignal` on SIGINT or SIGTERM, once everything started is stopped.
    """
    check_inputs(config)
    workspace_file = find_workspace(workspace)
    fresh = start_fresh(config)
    if fresh is not config:
        print(
            f"trinity-dagster: {config.run_root} holds a run already and "
            f"continue_from_checkpoint is false: training fresh as {fresh.name} in "
            f"{fresh.run_root}",
            flush=True,
        )
    with stop_signals_raise():
        return _train(fresh, workspace_file)


def _train(config: TrinityConfig, workspace_file: Path) -> dict[str, Any]:
    """`run_training` on a found workspace."""
    config_file = prepare_instance(config)
    if extend_finished_run(RunPaths.of_config(config), config.trainer.total_steps):
        print("trinity-dagster: extending a run that had stopped early", flush=True)
    import dagster as dg

    from trinity_dagster.checkpoint.hf_dir import hf_dir_written
    from trinity_dagster.checkpoint.layout import checkpoint_dir, latest_checkpoint_step
    from trinity_dagster.checkpoint.rules import sft_model_step

    paths = RunPaths.of_config(config)
    total = config.trainer.total_steps
    started = time.perf_counter()
    steps = f"{total} steps" if total is not None else "until the data ends"
    print(f"trinity-dagster: training {steps} under {paths.root} (dagster-daemon)", flush=True)
    instance = dg.DagsterInstance.get()
    progress = Progress(instance, config)
    daemon = start_daemon(paths, workspace_file)
    try:
        final_version, scored, lineage = _watch(progress, daemon, paths)
    finally:
        ignore_stop_signals()
        stop_run(daemon, paths)
    state = read_trainer_state(paths)
    assert state is not None
    evaluations = {"start": scored[0], "end": scored[final_version]}
    sft = sft_model_step(config)
    if sft in scored:
        evaluations["sft"] = scored[sft]
    accuracy = held_out_accuracy(config, evaluations)
    rollouts = [(step, reward) for step, reward, demo in progress.rollout_rewards() if not demo]
    rise = rollout_reward_rise([reward for _, reward in rollouts])
    final_step = latest_checkpoint_step(paths)
    final_ckpt = checkpoint_dir(paths, final_step) if final_step is not None else None
    hf_model = final_ckpt / "huggingface" if final_ckpt is not None else None
    summary = {
        "steps": state.step,
        "stopped_because": state.reason,
        **rise,
        **accuracy,
        "rollout_reward": {str(step): reward for step, reward in rollouts},
        TRAINED_EXACTLY_ONCE: lineage,
        "final_checkpoint": str(final_ckpt) if final_ckpt else None,
        "hf_model": str(hf_model) if hf_model and hf_dir_written(hf_model) else None,
        "dagster_home": str(paths.dagster_home),
        "dagster_dev": dagster_dev_command(config, config_file, workspace_file),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        "\n".join(
            [
                "",
                f"done in {summary['seconds']:.0f} s: {state.step} steps ({state.reason})",
                reward_line(summary),
                *accuracy_lines(summary),
                lineage_line(lineage),
                f"final checkpoint: {summary['final_checkpoint']}",
                f"HF model: {summary['hf_model']}",
                f"summary: {paths.root / 'summary.json'}",
                "inspect lineage and plots:",
                f"  {summary['dagster_dev']}",
            ]
        ),
        flush=True,
    )
    if not lineage["passed"]:
        raise TrainingRunError(f"trained_exactly_once failed: {lineage['problems']}")
    return summary


def lineage_line(check: dict[str, Any]) -> str:
    """The summary's line on the `trained_exactly_once` check."""
    if not check["passed"]:
        return f"trained_exactly_once FAILED: {check['problems']}"
    return (
        f"trained_exactly_once passed: {check['experiences_trained']} experiences trained once, "
        f"{check['experiences_dropped']} dropped as stale, "
        f"{check['experiences_unconsumed']} not consumed (of {check['experiences_written']})"
    )


REWARD_WINDOW = 25


def rollout_reward_rise(rewards: list[float]) -> dict[str, Any]:
    """The mean rollout reward of the first and the last RL steps (`REWARD_WINDOW` steps each,
    a quarter of the steps when there are fewer than 100), and the standard error of their
    difference (None when a window has one step)."""
    window = max(1, min(REWARD_WINDOW, len(rewards) // 4))
    first, last = rewards[:window], rewards[-window:]
    se = None
    if window > 1:
        se = (variance(first) / window + variance(last) / window) ** 0.5
    return {
        "reward_first": fmean(first) if rewards else None,
        "reward_last": fmean(last) if rewards else None,
        "reward_window": window,
        "reward_rise_se": se,
    }


def reward_line(summary: dict[str, Any]) -> str:
    """The summary's line on the rollout reward."""
    first, last, window = summary["reward_first"], summary["reward_last"], summary["reward_window"]
    if first is None:
        return "rollout reward: no RL steps"
    se = summary["reward_rise_se"]
    rise = f"{last - first:+.3f}" + (f" ± {se:.3f} s.e." if se is not None else "")
    return (
        f"rollout reward: first {window} RL steps {first:.3f} -> last {window} {last:.3f} ({rise})"
    )


def held_out_accuracy(
    config: TrinityConfig, evaluations: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """`accuracy_<when>` and `accuracy_<when>_ci95` ([low, high]) from the evaluation
    metadata of each point (start, sft, end), and `eval_tasks`, the held-out set's size."""
    from trinity_dagster.tasks import taskset_name

    prefix = f"eval/{taskset_name(config.explorer.eval_taskset)}"
    out: dict[str, Any] = {}
    for when in ("start", "sft", "end"):
        meta = evaluations.get(when)
        if meta is None:
            continue
        out[f"accuracy_{when}"] = meta.get(f"{prefix}/accuracy")
        interval = [meta.get(f"{prefix}/accuracy/ci95_{end}") for end in ("low", "high")]
        out[f"accuracy_{when}_ci95"] = interval if None not in interval else None
        if f"{prefix}/tasks" in meta:
            out["eval_tasks"] = int(meta[f"{prefix}/tasks"])
    return out


def accuracy_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's held-out accuracies, one line each, with their 95% intervals."""
    lines = []
    names = {"start": "before training", "sft": "after SFT", "end": "after RL"}
    for when, name in names.items():
        if f"accuracy_{when}" not in summary:
            continue
        value, interval = summary[f"accuracy_{when}"], summary[f"accuracy_{when}_ci95"]
        ci = f" (95% CI {interval[0]:.3f}-{interval[1]:.3f})" if interval else ""
        shown = f"{value:.3f}" if value is not None else "not recorded"
        lines.append(f"held-out accuracy {name}: {shown}{ci}")
    if "eval_tasks" in summary:
        lines.append(f"  (greedy, {summary['eval_tasks']} held-out tasks)")
    return lines


def _watch(
    progress: Progress, daemon: subprocess.Popen, paths: RunPaths
) -> tuple[int, dict[int, dict[str, Any]], dict[str, Any]]:
    """Print progress until training finished and its evaluations and lineage check are
    recorded; returns the final weights version, the evaluation metadata by weights version
    and the lineage check's result."""
    from trinity_dagster.checkpoint.layout import latest_weights_version
    from trinity_dagster.explorer.eval_versions import versions_to_evaluate

    config = progress.config
    paused_seen: float | None = None
    while True:
        raise_if_stopped()
        for line in progress.new_lines():
            print(line, flush=True)
        failure = progress.final_failure() or progress.sensor_failure()
        if failure is not None:
            raise TrainingRunError(failure)
        if daemon.poll() is not None:
            raise TrainingRunError(
                f"dagster-daemon exited with {daemon.returncode}; "
                f"see {paths.logs / 'dagster-daemon.log'}"
            )
        state = read_trainer_state(paths)
        if state is not None and state.state == "paused" and state.updated_at != paused_seen:
            paused_seen = state.updated_at
            print(
                f"trinity-dagster: training is paused at step {state.step} ({state.reason}); "
                "launch resume_training in the UI to go on",
                flush=True,
            )
        if state is not None and state.finished(config.trainer.total_steps):
            final = latest_weights_version(paths) or 0
            scored = {v: progress.evaluation(v) for v in versions_to_evaluate(config, paths, final)}
            lineage = progress.lineage_check(state.updated_at)
            if lineage is not None and all(meta is not None for meta in scored.values()):
                return final, {v: meta for v, meta in scored.items() if meta is not None}, lineage
        time.sleep(PROGRESS_POLL_S)
