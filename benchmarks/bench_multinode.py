"""Benchmark of the engine service on two nodes against one node with the same ranks.

On the tiny test model (CPU, DP=2, one torch thread per rank), the same pinned steps are
trained by:
- two "nodes" on loopback: this process starts node 0's agent, a second process joins as
  node 1 (`trinity-dagster engine join`), one rank each, meeting through the c10d rendezvous;
- one node with two ranks, the baseline, in the same run.
Figures:
- `two_node_s_per_step`, `one_node_s_per_step`: mean round trip of `train_step(N)` over the
  timed steps (step 1 warms the engine up and is not timed), and their ratio;
- `two_node_start_s`, `one_node_start_s`: from start until the service answers;
- `max_abs_weight_diff`: the largest difference between the final weights of the two runs
  (0.0: bit-identical), with `steps` (trained, the warm-up included) and `nodes`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from trinity_dagster.checkpoint.layout import weights_dir
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import connect, stop_service
from trinity_dagster.testing import fill_buffer, free_port, pin_steps, tiny_config

NODES = 2
JOIN = [sys.executable, "-m", "trinity_dagster.cli", "engine", "join"]


def _layout(tmp: Path, nodes: int, steps: int) -> tuple[TrinityConfig, Path]:
    """A DP=2 tiny-model run on `nodes` loopback nodes, with `steps` steps pinned."""
    service = {"nnodes": nodes, "rdzv_endpoint": f"127.0.0.1:{free_port()}"} if nodes > 1 else {}
    config, config_file = tiny_config(
        tmp / f"{nodes}-nodes",
        {
            "megatron": {"data_parallel_size": 2},
            "trainer": {"total_steps": steps + 100, "save_interval": 0},
            "synchronizer": {"sync_interval": steps + 100},
            "service": service,
        },
    )
    fill_buffer(config, steps)
    pin_steps(config, range(1, steps + 1))
    return config, config_file


def _joined_nodes(config: TrinityConfig, config_file: Path) -> list[subprocess.Popen]:
    """The agents of nodes 1.. of the config's layout, started in the background."""
    with open(Path(config.run_root).parent / "join.log", "ab") as log:
        return [
            subprocess.Popen(
                [*JOIN, "-c", str(config_file), "--node-rank", str(rank)], stdout=log, stderr=log
            )
            for rank in range(1, config.service.nnodes)
        ]


def _train(config: TrinityConfig, config_file: Path, steps: int) -> tuple[float, list[float], dict]:
    """(start-up s, s of each timed step, final weights) of one layout."""
    others = _joined_nodes(config, config_file)
    paths = RunPaths.of_config(config)
    started = time.perf_counter()
    try:
        with connect(config) as client:
            start_s = time.perf_counter() - started
            client.train_step(1)
            times = []
            for step in range(2, steps + 1):
                t0 = time.perf_counter()
                client.train_step(step)
                times.append(time.perf_counter() - t0)
            client.publish_weights(steps)
    finally:
        stop_service(paths)
        for process in others:
            process.wait(timeout=120)
    return start_s, times, load_file(weights_dir(paths, steps) / "model.safetensors")


def _max_abs_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of the same tensors."""
    assert a.keys() == b.keys()
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


def main() -> None:
    """Measure both layouts; print the figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6, help="trained steps (the first untimed)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank in both layouts
    with tempfile.TemporaryDirectory(prefix="bench_multinode_") as tmp:
        two_start, two_times, two_weights = _train(
            *_layout(Path(tmp), NODES, args.steps), args.steps
        )
        one_start, one_times, one_weights = _train(*_layout(Path(tmp), 1, args.steps), args.steps)
    figures = {
        "max_abs_weight_diff": _max_abs_diff(two_weights, one_weights),
        "steps": args.steps,
        "nodes": NODES,
        "two_node_s_per_step": round(statistics.fmean(two_times), 4),
        "one_node_s_per_step": round(statistics.fmean(one_times), 4),
        "two_vs_one_node_ratio": round(
            statistics.fmean(two_times) / statistics.fmean(one_times), 3
        ),
        "two_node_start_s": round(two_start, 2),
        "one_node_start_s": round(one_start, 2),
    }
    print(
        f"{NODES} nodes x 1 rank: {figures['two_node_s_per_step']:.3f} s/step, "
        f"1 node x 2 ranks: {figures['one_node_s_per_step']:.3f} s/step; "
        f"max |weight difference| {figures['max_abs_weight_diff']:g}"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
