"""Benchmark of Dagster orchestration overhead on training steps (engine-benchmark model, CPU).

The model and batch are those of `bench_engine.py` (hidden 512, 4 layers, 8 heads, vocab
8192, 8 full-length rows of 256 tokens, one micro-batch), so a step is seconds of engine work
and the ratio says what orchestration costs on a real step, not on a no-op one. The same N
steps on the same experiences are trained three ways, each in a fresh run root and a fresh
Python process (the code location reads its config at import), with the engine service
started and warmed (`status`) before the clock starts:
- direct: `EngineClient.train_step(n)` then `.publish_weights(n)` for n = 1..N, straight to the
  engine (the baseline);
- ranged: ONE single-run-backfill run of `train_job` over steps 1..N, executed in process on
  a real SQLite instance: the `train` multi-asset runs `Trainer.train` over the range, which
  pins (a no-op here), reads each batch for its metadata, trains, syncs, and logs
  `experience_batch`, `train_step` and `synced_weights` per step and the checks at the end;
- per-run: N runs of `train_job`, one per step, as a sensor would launch them (run key tag),
  also in process, so a real daemon's process launch per run (~ an import of dagster and the
  code location) comes on top.
The batches are pinned beforehand for all three, so every path trains on identical rows and
pinning is not timed. Each step publishes its weights (sync_interval 1, the `publish_weights`
call); no checkpoint is saved. The engine's own seconds per step (`time/train_step` +
`time/load_batch` of the step records under `logs/steps/`) are read the same way for all
three. The ways run in the order A B C C B A ... (`--repeats`), and the fastest run of each
way counts, which damps the noise of a shared machine. Figures: `ranged_vs_direct_ratio`
(goal <= 1.05) and `per_run_overhead_s` (per-run seconds per step minus direct seconds per
step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.graph_names import LOOP_SENSOR, TRAIN, TRAIN_JOB
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import connect, stop_service
from trinity_dagster.service_api.records import read_record
from trinity_dagster.testing import pin_steps, tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.bench_orchestration"

PHASES = ("direct", "ranged", "per_run")
# the model and batch of bench_engine.py (its defaults): a step is seconds of engine work
SEQ = 256
MODEL = {
    "hidden_size": 512,
    "ffn_hidden_size": 1408,
    "num_layers": 4,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "vocab_size": 8192,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2 * SEQ,
    "max_prompt_tokens": SEQ // 2,
    "max_response_tokens": SEQ // 2,
}
BATCH_ROWS = 8
GROUP = 4
ENGINE_TIMES = ("time/train_step", "time/load_batch")


def _rows(config: TrinityConfig, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Full-length GRPO rows (half prompt, half response) for `steps` steps, as in
    `benchmarks.synthetic.grpo_batch`: GRPO groups of `GROUP` rows with varied rewards."""
    import random
    import uuid
    from datetime import UTC, datetime

    rng = random.Random(seed)
    vocab = config.model.vocab_size
    half = SEQ // 2
    rows = []
    for g in range(steps * BATCH_ROWS // GROUP):
        prompt = [rng.randrange(3, vocab) for _ in range(half)]
        for r in range(GROUP):
            rows.append(
                {
                    "eid": str(uuid.UUID(int=rng.getrandbits(128))),
                    "task_id": f"t{g}",
                    "group_id": f"g{g}",
                    "explorer_id": "bench",
                    "tokens": prompt + [rng.randrange(3, vocab) for _ in range(half)],
                    "prompt_length": half,
                    "action_mask": [True] * half,
                    "logprobs": [-rng.uniform(8.5, 9.5) for _ in range(half)],
                    "reward": float(r % 2) + rng.random() * 0.1,
                    "advantages": None,
                    "returns": None,
                    "model_version": 0,
                    "created_at": datetime.now(UTC),
                    "info": "{}",
                }
            )
    return rows


def _prepare(root: Path, steps: int) -> TrinityConfig:
    """A run of the engine-benchmark model with `steps` steps of experiences, all pinned;
    the service warmed."""
    from trinity_dagster.buffer.writer import ExperienceWriter

    root.mkdir(parents=True)
    # weights are published every step (sync_interval 1); no checkpoint is written, as a
    # background save overlapping later steps makes the timings noisy
    extra = {
        "model": MODEL,
        "algorithm": {"repeat_times": GROUP, "recompute_old_logprobs": False},
        "buffer": {"train_batch_size": BATCH_ROWS},
        "trainer": {
            "total_steps": steps + 1000,
            "save_interval": 0,
            "micro_batch_size": BATCH_ROWS,
            "optim": {"lr": 1e-5},
        },
        "synchronizer": {"sync_interval": 1},
    }
    config, _ = tiny_config(root, extra)
    report = ExperienceWriter(config).write(_rows(config, steps))
    assert report.quarantined == 0, report
    pin_steps(config, range(1, steps + 1))
    with connect(config) as client:
        assert client.status()["step"] == 0
    return config


def _engine_seconds(config: TrinityConfig, steps: int) -> float:
    """The engine's own time for steps 1..N, from their records (train + batch load)."""
    paths = RunPaths.of_config(config)
    total = 0.0
    for step in range(1, steps + 1):
        record = read_record(paths, step)
        assert record is not None, f"step {step} has no record"
        total += sum(float(record["metrics"].get(name, 0.0)) for name in ENGINE_TIMES)
    return total


def _direct(config: TrinityConfig, steps: int) -> tuple[float, float]:
    with connect(config) as client:
        started = time.perf_counter()
        for step in range(1, steps + 1):
            client.train_step(step)
            client.publish_weights(step)
        seconds = time.perf_counter() - started
    return seconds, _engine_seconds(config, steps)


def _dagster(config: TrinityConfig, steps: int, ranged: bool) -> tuple[float, float]:
    from trinity_dagster.commands.daemon_control import prepare_instance

    prepare_instance(config)
    import dagster as dg

    from assets.definitions import defs
    from assets.partitions import step_key, step_partitions

    instance = dg.DagsterInstance.get()
    keys = [step_key(step) for step in range(1, steps + 1)]
    instance.add_dynamic_partitions(step_partitions.name, keys)
    job = defs.resolve_job_def(TRAIN_JOB)
    started = time.perf_counter()
    if ranged:
        result = job.execute_in_process(
            instance=instance,
            tags={
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[-1],
            },
        )
        assert result.success
    else:
        for key in keys:
            tags = {"dagster/run_key": f"train:{key}", "dagster/sensor_name": LOOP_SENSOR}
            result = job.execute_in_process(instance=instance, partition_key=key, tags=tags)
            assert result.success
    seconds = time.perf_counter() - started
    events = instance.fetch_materializations(dg.AssetKey(TRAIN), limit=steps + 1).records
    trained = sorted(record.asset_materialization.partition for record in events)
    assert trained == keys, f"trained partitions {trained} != {keys}"
    return seconds, _engine_seconds(config, steps)


def run_phase(phase: str, root: Path, steps: int) -> dict[str, Any]:
    """Time one way of training `steps` steps in the run root `root`."""
    config = _prepare(root, steps)
    try:
        if phase == "direct":
            seconds, engine_s = _direct(config, steps)
        else:
            seconds, engine_s = _dagster(config, steps, ranged=phase == "ranged")
    finally:
        stop_service(RunPaths.of_config(config))
    return {"phase": phase, "seconds": seconds, "engine_s": engine_s}


def _column(runs: dict[str, list[dict[str, float]]], key: str) -> dict[str, list[float]]:
    return {phase: [round(run[key], 3) for run in found] for phase, found in runs.items()}


def main() -> None:
    """Run each phase in its own process; print the figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way (min is kept)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.root, args.steps)))
        return
    runs: dict[str, list[dict[str, float]]] = {phase: [] for phase in PHASES}
    order = [*PHASES, *reversed(PHASES)] * ((args.repeats + 1) // 2)
    with tempfile.TemporaryDirectory(prefix="bench_orchestration_") as tmp:
        for index, phase in enumerate(order[: len(PHASES) * args.repeats]):
            root = f"{tmp}/{index}-{phase}"
            command = [sys.executable, "-m", MODULE, "--phase", phase, "--root", root]
            done = subprocess.run(
                [*command, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
            )
            if done.returncode != 0:
                tail = done.stdout[-3000:] + done.stderr[-5000:]
                raise SystemExit(f"phase {phase} failed:\n{tail}")
            runs[phase].append(json.loads(done.stdout.strip().splitlines()[-1]))
            wall, engine = runs[phase][-1]["seconds"], runs[phase][-1]["engine_s"]
            print(f"{phase:8s} {wall:7.2f} s for {args.steps} steps ({engine:.2f} s in the engine)")
    fastest = {phase: min(found, key=lambda run: run["seconds"]) for phase, found in runs.items()}
    seconds = {phase: run["seconds"] for phase, run in fastest.items()}
    # wall time outside the engine's own step work: robust to the engine's timing noise
    outside = {phase: run["seconds"] - run["engine_s"] for phase, run in fastest.items()}
    n = args.steps
    figures = {
        "steps": n,
        "direct_s": round(seconds["direct"], 3),
        "ranged_s": round(seconds["ranged"], 3),
        "per_run_s": round(seconds["per_run"], 3),
        "ranged_vs_direct_ratio": round(seconds["ranged"] / seconds["direct"], 3),
        "per_run_overhead_s": round((seconds["per_run"] - seconds["direct"]) / n, 3),
        "direct_step_s": round(seconds["direct"] / n, 3),
        "outside_engine_per_step_s": {phase: round(t / n, 3) for phase, t in outside.items()},
        "raw_s": _column(runs, "seconds"),
        "raw_engine_s": _column(runs, "engine_s"),
        "goal_ranged_vs_direct_ratio": 1.05,
        "pinned_beforehand": True,
        "runs_in_process": True,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
