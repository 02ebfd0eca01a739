"""A whole training run driven by the Dagster daemon, for `trinity-dagster demo` and `run`.

The command prepares the run's Dagster instance under `run_root/dagster_home` (the settings
of `trinity_dagster.dagster_instance`), starts the workspace's code server itself
(`code_server`), runs Dagster's daemon on it in the command's own process
(`daemon_in_process`), and watches the instance: the daemon's sensors start the trainer and
explorer loops and the evaluations, exactly as under `dagster dev`. It prints one line per
recorded explore and train step, fails with the cause when a run fails for good, and ends
when the trainer finished, the final weights are evaluated and `trained_exactly_once` has
checked the run's lineage (a failed check fails the command). `dagster dev` on the same
instance shows the whole history afterwards. SIGINT or SIGTERM stops the daemon, the code
server with its run workers and the run root's engine service (also one still starting)
before the command exits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from trinity_dagster.commands.code_server import (
    CodeServers,
    exited_code_server,
    remove_sockets,
    start_code_servers,
    wait_until_serving,
)
from trinity_dagster.commands.daemon_control import (
    dagster_dev_command,
    find_workspace,
    ignore_stop_signals,
    prepare_instance,
    raise_if_stopped,
    stop_run,
    stop_signals_deferred,
    stop_signals_raise,
)
from trinity_dagster.commands.daemon_in_process import DaemonInProcess
from trinity_dagster.commands.errors import TrainingRunError
from trinity_dagster.commands.instance_progress import Progress
from trinity_dagster.commands.run_summary import (
    accuracy_lines,
    held_out_accuracy,
    lineage_line,
    reward_line,
    rollout_reward_rise,
)
from trinity_dagster.config import TrinityConfig, check_inputs, start_fresh
from trinity_dagster.graph_names import ROLLOUTS_JOB, TRAINED_EXACTLY_ONCE
from trinity_dagster.handoff.end_of_data import clear_end_of_data
from trinity_dagster.handoff.trainer_state import (
    finished_training,
    read_trainer_state,
    state_path,
)
from trinity_dagster.paths import RunPaths

log = logging.getLogger(__name__)

PROGRESS_POLL_S = 1.0
# between reads of failed runs and sensor ticks (about 20 ms of CPU each time)
FAILURE_POLL_S = 5.0
# how long a stop waits for the early engine start to have started its processes
ENGINE_LAUNCH_WAIT_S = 10.0
# how long the end waits for the explorer's run, once it recorded the run's scores, to end
RUN_END_GRACE_S = 30.0


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
        try:
            return _train(fresh, workspace_file)
        except Exception:
            # a stop signal raised inside a library that wrapped it (SQLAlchemy does, into a
            # StatementError) still ends the command as stopped by that signal
            raise_if_stopped()
            raise


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
    # opened before the code servers start, which open it too: two processes creating a
    # fresh instance's storages at once can both stamp their schema version, and the next
    # process to open them fails
    instance = dg.DagsterInstance.get()
    progress = Progress(instance, config)
    engine_launched: threading.Event | None = None
    servers: CodeServers | None = None
    daemon: DaemonInProcess | None = None
    try:  # a stop signal may come at any point from here: stop whatever has started
        with stop_signals_deferred():
            engine_launched = start_engine_early(config)
            servers = start_code_servers(paths, workspace_file)
        wait_until_serving(servers, paths)
        with stop_signals_deferred():
            daemon = DaemonInProcess(instance, servers.workspace, paths.daemon_log)
        final_version, scored, lineage = _watch(progress, daemon, servers, paths)
    finally:
        ignore_stop_signals()
        if engine_launched is not None:
            engine_launched.wait(timeout=ENGINE_LAUNCH_WAIT_S)
        stop_run(daemon, servers.processes if servers else [], paths)
        if servers is not None:
            remove_sockets(servers)
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
    paths.summary_file.write_text(json.dumps(summary, indent=1))
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
                f"summary: {paths.summary_file}",
                "inspect lineage and plots:",
                f"  {summary['dagster_dev']}",
            ]
        ),
        flush=True,
    )
    if not lineage["passed"]:
        raise TrainingRunError(f"trained_exactly_once failed: {lineage['problems']}")
    return summary


def start_engine_early(config: TrinityConfig) -> threading.Event:
    """Start the run's engine service in a thread, beside the daemon's own start-up, unless
    training finished already; the trainer run attaches to it (or waits on the start lock
    while it comes up). Started by the trainer run instead, the engine's 6-8 s start-up came
    after the daemon's first sensor tick and the run's launch.

    The event returned is set once the service's processes are started (or none will be), so
    that stopping the run finds every process it must end.
    """
    from trinity_dagster.service.launcher import start_service
    from trinity_dagster.service.owner import this_process

    launched = threading.Event()
    paths = RunPaths.of_config(config)
    if finished_training(paths, config.trainer.total_steps) is not None:
        launched.set()
        return launched

    def start() -> None:
        try:
            start_service(config, launched=launched.set, owner=this_process())
        except Exception as err:  # the trainer run starts it again and fails with the cause
            log.debug("early engine start failed (the trainer run retries it): %s", err)

    threading.Thread(target=start, name="engine-start", daemon=True).start()
    return launched


def _watch(
    progress: Progress, daemon: DaemonInProcess, servers: CodeServers, paths: RunPaths
) -> tuple[int, dict[int, dict[str, Any]], dict[str, Any]]:
    """Print progress until training finished and its evaluations and lineage check are
    recorded; returns the final weights version, the evaluation metadata by weights version
    and the lineage check's result."""
    from trinity_dagster.checkpoint.layout import latest_weights_version
    from trinity_dagster.explorer.eval_versions import versions_to_evaluate

    config = progress.config
    paused_seen: float | None = None
    scored_at: float | None = None
    failures_read_at: float | None = None
    while True:
        raise_if_stopped()
        for line in progress.new_lines():
            print(line, flush=True)
        now = time.monotonic()
        if failures_read_at is None or now - failures_read_at >= FAILURE_POLL_S:
            failures_read_at = now
            failure = progress.final_failure() or progress.sensor_failure()
            if failure is not None:
                raise TrainingRunError(failure)
        daemon.check()
        if (server := exited_code_server(servers)) is not None:
            raise TrainingRunError(
                f"the Dagster code server exited with {server.returncode}; "
                f"see {paths.code_server_log}"
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
                scored_at = scored_at or time.monotonic()
                # the explorer's run scored them: let it end before the daemon stops
                if (
                    not progress.run_going(ROLLOUTS_JOB)
                    or time.monotonic() - scored_at > RUN_END_GRACE_S
                ):
                    return (
                        final,
                        {v: meta for v, meta in scored.items() if meta is not None},
                        lineage,
                    )
        time.sleep(PROGRESS_POLL_S)
