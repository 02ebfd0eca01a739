"""The cost of one GRPO step of the demo config through the daemon, for each sync method.

For each `synchronizer.sync_method` (`checkpoint`, then `memory`), in a fresh run root and a
fresh Python process, `run_training` (what `trinity-dagster run` does) drives the demo model
through the real daemon: `--sft-steps` SFT warm-up steps, then `--steps` GRPO steps (built-in
explorer, engine service, weights synced every step). A step's wall time is the time between
consecutive `train_step[N]` materialisations; medians are over the GRPO steps after the first
(the warm-up steps are excluded). Figures per sync method:
- `step_s`: median wall per step;
- `compute_s` = `generate_s` (the explorer's `time/generate`: load the weights, generate)
  + `train_compute_s` (the engine's `time/train_step`: forward/backward/optimizer);
- `overhead_s` = `step_s` - `compute_s` (goal <= 0.04 s);
- `first_step_s`: from the start of `run_training` to the first trained step (goal <= 10 s);
- `end_s`: from the last trained step to the end of `run_training`: final save, HF export,
  evaluations, stopping the daemon (goal <= 10 s);
- `peak_pss_mb`: the largest summed PSS of this process, all it started and the engine
  service, sampled every 2 s (goal <= 1,200 MB), and `pss_at_peak_mb`, its parts;
- `start_cpu_s`: the CPU seconds each of those processes used before the first trained step
  (run workers named by their job; those under 0.05 s left out), `start_cpu_total_s` their
  sum, and `start_idle_core_s` what the machine's cores left unused meanwhile (cores x
  `first_step_s` - the sum): a start that waits on one process at a time leaves cores idle;
- `parts`: medians of the attributable non-compute parts: `read_experience` (trainer pins the
  batch), `engine_load_batch` (the engine reads it), `http_round_trip` (`train_step` call
  minus engine load and compute), `sync_weight`, `wait_weights` (explorer waits for the
  version), `write_experiences` (explorer's Delta append).
`--sync-offset 1` lets the explorer run one step ahead (generation beside training).
Run from the repository root (the daemon loads `workspace.yaml` there).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.bench_daemon import run_isolated, step_times, train_metadata
from benchmarks.process_cpu import CpuTimeline
from benchmarks.process_memory import PeakPss
from trinity_dagster.commands.daemon_control import engine_processes
from trinity_dagster.config import load_config
from trinity_dagster.graph_names import TRAIN
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.service_api.records import read_record

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.bench_step"
SYNC_METHODS = ("checkpoint", "memory")
GOAL_OVERHEAD_S = 0.04


def _median(values: list[float]) -> float | None:
    return round(median(values), 4) if values else None


def _rollout_metadata(instance: Any) -> dict[int, dict[str, Any]]:
    import dagster as dg

    from trinity_dagster.commands.instance_progress import metadata_values

    records = instance.fetch_materializations(dg.AssetKey("rollouts"), limit=10_000).records
    found: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r.storage_id):
        event = record.asset_materialization
        if event is not None and event.partition:
            found.setdefault(int(event.partition), metadata_values(event))
    return found


def run_method(
    method: str,
    root: Path,
    sft_steps: int,
    steps: int,
    sync_offset: int = 0,
    overrides: Mapping[str, object] | None = None,
    *,
    sample_memory: bool = True,
) -> dict[str, Any]:
    """`run_training` with `method` (and config `overrides`, dotted keys, on top of the demo's);
    the step's wall time and its parts, as medians, and with `sample_memory` the peak PSS
    (its sampler takes CPU from the run it measures)."""
    from trinity_dagster.commands.training_run import run_training

    total = sft_steps + steps
    config = load_config(
        None,
        overrides={
            "run_root": str(root),
            "trainer.total_steps": total,
            "trainer.sft_warmup_steps": sft_steps,
            "trainer.save_interval": 0,
            "synchronizer.sync_method": method,
            "synchronizer.sync_offset": sync_offset,
            **(overrides or {}),
        },
    )
    paths = RunPaths.of_config(config)
    started = time.time()
    try:
        stdout, sys.stdout = sys.stdout, sys.stderr  # stdout ends with one JSON line
        try:
            memory = PeakPss(extra=lambda: engine_processes(paths)) if sample_memory else None
            # sampled until step 2 is trained: only the start is read from it (step 1's
            # materialisation is logged by then), and sampling costs the run 7% of a core
            cpu = CpuTimeline(
                extra=lambda: engine_processes(paths),
                until=lambda: read_record(paths, 2) is not None,
            )
            with memory or contextlib.nullcontext(), cpu:
                run_training(config, REPO_ROOT / "workspace.yaml")
        finally:
            sys.stdout = stdout
    finally:
        stop_service(paths)
    ended = time.time()
    import dagster as dg

    instance = dg.DagsterInstance.get()  # DAGSTER_HOME set by run_training
    trained = step_times(instance, TRAIN)
    assert sorted(trained) == list(range(1, total + 1)), f"trained steps {sorted(trained)}"
    steady = list(range(sft_steps + 2, total + 1))  # GRPO steps with a GRPO step before them
    walls = [
        trained[b] - trained[a] for a, b in itertools.pairwise(range(sft_steps + 1, total + 1))
    ]
    meta = train_metadata(instance)
    rollouts = _rollout_metadata(instance)
    metrics = [r["metrics"] for r in (read_record(paths, s) for s in steady) if r is not None]

    def trainer(name: str) -> list[float]:
        return [float(meta[s][name]) for s in steady if name in meta[s]]

    def explorer(name: str) -> list[float]:
        return [float(rollouts[s][name]) for s in steady if name in rollouts.get(s, {})]

    start_cpu = _start_cpu(cpu, instance, started, trained[1])
    train = [float(m["time/train_step"]) for m in metrics]
    load = [float(m.get("time/load_batch", 0.0)) for m in metrics]
    calls = trainer("time/train_step_call")
    step_s, generate_s, train_s = median(walls), median(explorer("time/generate")), median(train)
    compute_s = generate_s + train_s
    return {
        "sync_method": method,
        "sync_offset": sync_offset,
        "grpo_steps": steps,
        "step_s": round(step_s, 4),
        "compute_s": round(compute_s, 4),
        "overhead_s": round(step_s - compute_s, 4),
        "first_step_s": round(trained[1] - started, 2),
        "start_cpu_s": start_cpu,
        "start_cpu_total_s": round(sum(start_cpu.values()), 2),
        "start_idle_core_s": round(
            len(os.sched_getaffinity(0)) * (trained[1] - started) - sum(start_cpu.values()), 2
        ),
        "end_s": round(ended - trained[total], 2),
        **(
            {"peak_pss_mb": round(memory.peak_mb), "pss_at_peak_mb": memory.at_peak}
            if memory is not None
            else {}
        ),
        "parts": {
            "generate_s": round(generate_s, 4),
            "train_compute_s": round(train_s, 4),
            "read_experience_s": _median(trainer("time/read_experience")),
            "engine_load_batch_s": _median(load),
            "http_round_trip_s": _median(
                [c - t - b for c, t, b in zip(calls, train, load, strict=False)]
            ),
            "sync_weight_s": _median(trainer("time/sync_weight")),
            "trainer_step_s": _median(trainer("time/step")),
            "wait_weights_s": _median(explorer("time/wait_weights")),
            "write_experiences_s": _median(explorer("time/write_experiences")),
        },
        "step_walls_s": [round(w, 3) for w in walls],
    }


def _start_cpu(
    cpu: CpuTimeline, instance: Any, started: float, first_step: float
) -> dict[str, float]:
    """CPU seconds each process used from `started` to `first_step` by label (a run worker
    by its run's job), largest first, those of 0.05 s or more."""
    from assets.sensors import worker_pid

    labels = dict(cpu.labels)
    for run in instance.get_runs():
        pid = worker_pid(instance, run)
        if pid is not None:
            labels[pid] = f"run worker ({run.job_name})"
    used: dict[str, float] = {}
    for pid, seconds in cpu.used_between(started, first_step).items():
        label = labels.get(pid, str(pid))
        used[label] = used.get(label, 0.0) + seconds
    ranked = sorted(used.items(), key=lambda item: -item[1])
    return {label: round(seconds, 2) for label, seconds in ranked if seconds >= 0.05}


def main() -> None:
    """Run each sync method in its own process; print the figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per sync method")
    parser.add_argument("--sft-steps", type=int, default=2, help="SFT warm-up steps (excluded)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per sync method")
    parser.add_argument(
        "--sync-offset", type=int, default=0, help="explore steps the explorer may run ahead"
    )
    parser.add_argument("--keep", type=Path, help="keep the run roots under this directory")
    parser.add_argument("--method", choices=SYNC_METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3")
    if args.method:
        print(
            json.dumps(
                run_method(args.method, args.root, args.sft_steps, args.steps, args.sync_offset)
            )
        )
        return
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        base = args.keep or Path(tmp)
        for method in SYNC_METHODS:
            extra = ["--steps", str(args.steps), "--sft-steps", str(args.sft_steps)]
            extra += ["--sync-offset", str(args.sync_offset)]
            found = run_isolated(
                MODULE, "method", method, base / f"{method}-run", extra, args.timeout_s
            )
            results[method] = found
            print(
                f"{method:10s} step {found['step_s']:.3f} s, compute {found['compute_s']:.3f} s, "
                f"overhead {found['overhead_s']:.3f} s; parts {found['parts']}",
                flush=True,
            )
    print(
        json.dumps(
            {
                "steps": args.steps,
                "sft_steps": args.sft_steps,
                "goal_overhead_s": GOAL_OVERHEAD_S,
                "goal_met": all(r["overhead_s"] <= GOAL_OVERHEAD_S for r in results.values()),
                **{method: results[method] for method in SYNC_METHODS},
            }
        )
    )


if __name__ == "__main__":
    main()
