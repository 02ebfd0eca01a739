"""Benchmark of the engine service's control path: what a command costs beyond its compute.

On a tiny model (CPU), with saves and syncs switched off between steps so that a train call
is control path + compute only:
- `call_overhead_ms`: round trip of `train_step(N)` minus the engine's own compute time of
  step N (its `time/train_step` metric), averaged over the timed steps (goal <= 50 ms); it
  includes `read_experience_ms`, the engine reading the step's batch from Delta;
- `record_rtt_ms`: round trip of `train_step(N)` for a step already trained (the recorded
  result comes back, nothing is computed);
- `status_rtt_ms`: round trip of `status()`;
- `attach_s`: a fresh Python process that imports the launcher, attaches to the running
  service and asks its status, raw and net of a bare `python -c pass` measured the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import connect, stop_service
from trinity_dagster.testing import fill_buffer, pin_steps, tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]

ATTACH_SCRIPT = (
    "import sys; from trinity_dagster.config import load_config; "
    "from trinity_dagster.service.launcher import connect; "
    "client = connect(load_config(sys.argv[1]), autostart=False); "
    "assert client.status()['health'] == 'ok'"
)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _median_process_s(command: list[str], repeats: int) -> float:
    """Median wall time of running `command` to completion (it must succeed)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO_ROOT, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    """Measure the control path; print the figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="timed train steps")
    parser.add_argument("--calls", type=int, default=50, help="timed status/record calls")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process attaches")
    args = parser.parse_args()
    steps = args.steps + 1  # step 1 warms the engine (first forward/backward, allocations)
    with tempfile.TemporaryDirectory(prefix="bench_service_") as tmp:
        config, config_file = tiny_config(
            Path(tmp),
            {
                "trainer": {"total_steps": steps + 100, "save_interval": 0},
                "synchronizer": {"sync_interval": steps + 100},
            },
        )
        paths = RunPaths.of_config(config)
        fill_buffer(config, steps)
        pin_steps(config, range(1, steps + 1))
        started = time.perf_counter()
        client = connect(config)
        start_s = time.perf_counter() - started
        try:
            client.train_step(1)
            rtts, computes, reads = [], [], []
            for step in range(2, steps + 1):
                t0 = time.perf_counter()
                record = client.train_step(step)
                rtts.append(time.perf_counter() - t0)
                computes.append(float(record["metrics"]["time/train_step"]))
                reads.append(float(record["metrics"].get("time/load_batch", 0.0)))
                assert not record["already_trained"], record
            overheads = [rtt - compute for rtt, compute in zip(rtts, computes, strict=True)]

            def timed(call) -> float:
                call()  # warm the connection
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                return (time.perf_counter() - t0) / args.calls

            status_s = timed(client.status)
            record_s = timed(lambda: client.train_step(steps))
            attach_raw = _median_process_s(
                [sys.executable, "-c", ATTACH_SCRIPT, str(config_file)], args.repeats
            )
            bare = _median_process_s([sys.executable, "-c", "pass"], args.repeats)
        finally:
            client.close()
            stop_service(paths)
    figures = {
        "call_overhead_ms": _ms(statistics.fmean(overheads)),
        "call_overhead_ms_max": _ms(max(overheads)),
        "train_rtt_ms": _ms(statistics.fmean(rtts)),
        "train_compute_ms": _ms(statistics.fmean(computes)),
        "read_experience_ms": _ms(statistics.fmean(reads)),
        "record_rtt_ms": _ms(record_s),
        "status_rtt_ms": _ms(status_s),
        "attach_s": round(attach_raw - bare, 3),
        "attach_raw_s": round(attach_raw, 3),
        "python_startup_s": round(bare, 3),
        "service_start_s": round(start_s, 3),
        "timed_steps": len(rtts),
        "goal_call_overhead_ms": 50,
    }
    print(
        f"train_step: rtt {figures['train_rtt_ms']:.1f} ms, compute "
        f"{figures['train_compute_ms']:.1f} ms -> overhead {figures['call_overhead_ms']:.1f} ms"
    )
    print(f"status {status_s * 1000:.2f} ms, recorded step {record_s * 1000:.2f} ms")
    print(f"attach from a fresh process: {attach_raw:.2f} s raw, {bare:.2f} s bare python")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
