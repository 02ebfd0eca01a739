"""The RFT loop driven by the real Dagster daemon vs the same loop as a plain Python loop.

The demo model (the embedded defaults of `trinity_dagster.config`) does `--steps` GRPO steps
(no SFT warm-up, no periodic checkpoint, weights synced to the explorer every step, so each
explore step waits for the previous train step's weights), two ways, each in a fresh run root
and a fresh Python process:
- daemon: `run_training` (what `trinity-dagster run`/`demo` do): the instance settings are
  written, the daemon runs headless on `workspace.yaml`'s code server, and its sensors launch
  the long-lived trainer run (`Trainer.train`) and explorer run (`ExplorerLoop`), plus the
  evaluations of the initial and the final weights. A step finishes at its `train_step[N]`
  materialisation (the instance's event timestamp, logged after the step's train and sync);
- direct (the baseline): one `Explorer` (model kept loaded) in this process, then for each
  step: explore with the newest weights, `ExperienceWriter.write`, `pin_batch`, and the
  engine service's `EngineClient.train_step(n)` and `.publish_weights(n)` (the last step is not
  synced: its final save serves, as in `Trainer`); a step finishes when its calls return.
Seconds per step in steady state = (finish of the last step - finish of the first) /
(steps - 1); start-up = finish of the first step - start (both include starting the engine
service; the daemon's also its sensors' first ticks and launching two runs). Neither counts
the final blocking save nor the final evaluation. Figures: `daemon_vs_direct_ratio` (goal
<= 1.25), `daemon_startup_s`, `direct_startup_s`; `where_time_goes` splits a steady step.
Run from the repository root (the daemon loads `workspace.yaml` there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from trinity_dagster.commands.instance_progress import metadata_values
from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.graph_names import TRAIN
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.service_api.records import read_record

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.bench_daemon"

PHASES = ("direct", "daemon")
GOAL_RATIO = 1.25


def bench_config(root: Path, steps: int, save_interval: int) -> TrinityConfig:
    """The demo's configuration on `root`: GRPO from step 1, `steps` steps."""
    return load_config(
        None,
        overrides={
            "run_root": str(root),
            "trainer.total_steps": steps,
            "trainer.sft_warmup_steps": 0,
            "trainer.save_interval": save_interval,
        },
    )


def per_step(finished: dict[int, float], started: float) -> dict[str, Any]:
    """Steady-state seconds per step and start-up seconds from finish times by step."""
    steps = sorted(finished)
    first, last = finished[steps[0]], finished[steps[-1]]
    return {
        "s_per_step": (last - first) / (len(steps) - 1),
        "startup_s": first - started,
        "step_s": [round(finished[b] - finished[a], 3) for a, b in itertools.pairwise(steps)],
    }


def _mean(values: list[float]) -> float | None:
    return round(fmean(values), 3) if values else None


def engine_seconds(paths: RunPaths, steps: list[int]) -> dict[str, float | None]:
    """Mean engine-side seconds (train, batch load) of `steps`, from the step records."""
    records = [read_record(paths, step) for step in steps]
    metrics = [r["metrics"] for r in records if r is not None]
    return {
        "engine_train": _mean([float(m["time/train_step"]) for m in metrics]),
        "engine_load_batch": _mean([float(m.get("time/load_batch", 0.0)) for m in metrics]),
    }


# --- direct ------------------------------------------------------------------------------
def run_direct(root: Path, steps: int, save_interval: int) -> dict[str, Any]:
    """The plain loop: explorer in process, engine service by its client, sync every step."""
    started = time.perf_counter()
    config = bench_config(root, steps, save_interval)
    from trinity_dagster.buffer.sampler import PinResult, pin_batch
    from trinity_dagster.buffer.writer import ExperienceWriter
    from trinity_dagster.checkpoint.initial_weights import create_initial_model
    from trinity_dagster.checkpoint.rules import explorer_weights_version
    from trinity_dagster.explorer.explorer import Explorer
    from trinity_dagster.service.launcher import connect

    paths = RunPaths.of_config(config)
    sync = config.synchronizer
    create_initial_model(config, paths)
    explorer = Explorer(config, paths)
    finished: dict[int, float] = {}
    parts: dict[str, list[float]] = {k: [] for k in ("explore", "write", "pin", "train", "sync")}
    try:
        with connect(config) as client:
            for step in range(1, steps + 1):
                marks = [time.perf_counter()]
                version = explorer_weights_version(
                    step, sync_interval=sync.sync_interval, sync_offset=sync.sync_offset
                )
                rows = explorer.explore(step, version)
                marks.append(time.perf_counter())
                writer = ExperienceWriter(
                    config, known_versions=lambda v=version: set(range(v + 1))
                )
                report = writer.write(rows)
                assert report.quarantined == 0, report
                marks.append(time.perf_counter())
                assert isinstance(pin_batch(config, step), PinResult), f"step {step} not pinned"
                marks.append(time.perf_counter())
                client.train_step(step)
                marks.append(time.perf_counter())
                due = step % sync.sync_interval == 0 and step < steps
                if due:  # the last step's final save serves as its sync (as in Trainer)
                    client.publish_weights(step)
                marks.append(time.perf_counter())
                finished[step] = marks[-1]
                if step > 1:  # steady state only
                    for name, (a, b) in zip(parts, itertools.pairwise(marks), strict=True):
                        parts[name].append(b - a)
                print(f"direct step {step}: {marks[-1] - marks[0]:.2f} s", file=sys.stderr)
            client.save_checkpoint(steps, block=True, hf=True)  # the final save, not timed
    finally:
        stop_service(paths)
    figures = per_step(finished, started)
    figures["where_time_goes"] = {
        **{name: _mean(values) for name, values in parts.items()},
        **engine_seconds(paths, list(range(2, steps + 1))),
    }
    return figures


# --- daemon ------------------------------------------------------------------------------
def step_times(instance: Any, asset: str) -> dict[int, float]:
    """The event timestamp of the first materialisation of each step partition of `asset`."""
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetKey(asset), limit=10_000).records
    times: dict[int, float] = {}
    for record in sorted(records, key=lambda r: r.storage_id):
        event = record.asset_materialization
        if event is not None and event.partition is not None:
            times.setdefault(int(event.partition), record.timestamp)
    return times


def train_metadata(instance: Any) -> dict[int, dict[str, Any]]:
    """The metadata of each step's `train_step` materialisation, as plain values."""
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetKey(TRAIN), limit=10_000).records
    return {
        int(r.asset_materialization.partition): metadata_values(r.asset_materialization)
        for r in records
        if r.asset_materialization is not None and r.asset_materialization.partition
    }


def run_daemon(root: Path, steps: int, save_interval: int) -> dict[str, Any]:
    """`run_training` on the demo config; step finish times from the instance."""
    started = time.time()
    config = bench_config(root, steps, save_interval)
    from trinity_dagster.commands.training_run import run_training

    paths = RunPaths.of_config(config)
    try:
        # its progress lines go to stderr: this process's stdout ends with one JSON line
        stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            summary = run_training(config, REPO_ROOT / "workspace.yaml")
        finally:
            sys.stdout = stdout
    finally:
        stop_service(paths)
    import dagster as dg

    instance = dg.DagsterInstance.get()  # DAGSTER_HOME set by run_training
    trained = step_times(instance, TRAIN)
    explored = step_times(instance, "rollouts")
    assert sorted(trained) == list(range(1, steps + 1)), f"trained steps {sorted(trained)}"
    figures = per_step(trained, started)
    records = {step: read_record(paths, step) for step in trained}
    trained_at = {step: r["trained_at"] for step, r in records.items() if r is not None}
    figures["s_per_step_by_trained_at"] = round(per_step(trained_at, started)["s_per_step"], 3)
    meta = train_metadata(instance)
    steady = list(range(2, steps + 1))
    trainer_side = {
        # rollouts[N] logged -> train_step[N] logged: the trainer notices the data, pins,
        # trains, syncs, and logs
        "rollouts_to_train_step": _mean([trained[s] - explored[s] for s in steady]),
        # train_step[N-1] logged -> rollouts[N] logged: the explorer notices the weights,
        # loads them, explores, writes, and logs
        "train_step_to_next_rollouts": _mean([explored[s] - trained[s - 1] for s in steady]),
    }
    trainer_timers = {
        name.removeprefix("time/"): _mean([float(meta[s][name]) for s in steady if name in meta[s]])
        for name in (
            "time/read_experience",
            "time/train_step_call",
            "time/publish_weights",
            "time/step",
        )
    }
    figures["where_time_goes"] = {
        **trainer_side,
        **{f"trainer_{k}": v for k, v in trainer_timers.items()},
        **engine_seconds(paths, steady),
    }
    figures["total_s"] = summary["seconds"]
    figures["stopped_because"] = summary["stopped_because"]
    return figures


def run_phase(phase: str, root: Path, steps: int, save_interval: int) -> dict[str, Any]:
    """Time one way of running the loop in the run root `root`."""
    run = run_direct if phase == "direct" else run_daemon
    return {"phase": phase, **run(root, steps, save_interval)}


def run_isolated(
    module: str, option: str, value: str, root: Path, extra: list[str], timeout_s: float
) -> dict[str, Any]:
    """The JSON last line of `python -m module --option value --root root *extra`, run from
    the repository root in a fresh process; a service left in `root` is stopped on failure."""
    command = [sys.executable, "-m", module, f"--{option}", value, "--root", str(root), *extra]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as err:
        stop_service(RunPaths.of(root))
        raise SystemExit(f"{value} ran past {timeout_s:g} s") from err
    if done.returncode != 0:
        stop_service(RunPaths.of(root))
        raise SystemExit(f"{value} failed:\n{done.stdout[-3000:]}{done.stderr[-5000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run each way in its own process; print the figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps (>= 10 for the goal)")
    parser.add_argument("--save-interval", type=int, default=0, help="trainer.save_interval")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per way")
    parser.add_argument("--keep", type=Path, help="keep the run roots under this directory")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.root, args.steps, args.save_interval)))
        return
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_daemon_") as tmp:
        base = args.keep or Path(tmp)
        for phase in PHASES:
            extra = ["--steps", str(args.steps), "--save-interval", str(args.save_interval)]
            results[phase] = run_isolated(
                MODULE, "phase", phase, base / f"{phase}-run", extra, args.timeout_s
            )
            found = results[phase]
            print(
                f"{phase:7s} {found['s_per_step']:.3f} s/step in steady state, "
                f"start-up {found['startup_s']:.1f} s; steps: {found['step_s']}",
                flush=True,
            )
    daemon, direct = results["daemon"], results["direct"]
    figures = {
        "steps": args.steps,
        "daemon_s_per_step": round(daemon["s_per_step"], 3),
        "direct_s_per_step": round(direct["s_per_step"], 3),
        "daemon_vs_direct_ratio": round(daemon["s_per_step"] / direct["s_per_step"], 3),
        "daemon_startup_s": round(daemon["startup_s"], 1),
        "direct_startup_s": round(direct["startup_s"], 1),
        "daemon_s_per_step_by_trained_at": daemon["s_per_step_by_trained_at"],
        "daemon_total_s": daemon["total_s"],
        "daemon_step_s": daemon["step_s"],
        "direct_step_s": direct["step_s"],
        "where_time_goes": {
            "daemon": daemon["where_time_goes"],
            "direct": direct["where_time_goes"],
        },
        "save_interval": args.save_interval,
        "goal_daemon_vs_direct_ratio": GOAL_RATIO,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
