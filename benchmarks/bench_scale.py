"""Benchmark of a long run's state: the UI, the sensor, the instance and the Delta tables at
1,000 / 10,000 / 50,000 steps.

The state of a run of N steps is built without training (`scale_state`): real Dagster
events with the real per-step metadata in a SQLite instance (the one `trinity-dagster run`
writes) and in a PostgreSQL one (a throwaway local server), and real Delta commits of the
demo's size through the explorer's writer and the trainer's pin, with the Delta maintenance
the sensor launches. At each size it measures:
- `ui_query_s`: the slowest GraphQL query of the `train_step` and `checkpoint` asset pages
  (overview, partitions, events, checks) and of the asset graph's sidebar of `train_step`
  (with its metadata plots), as
  headless Chromium sends them to a running `dagster-webserver`, each replayed over HTTP
  (median of 3);
- `sensor_tick_s`: one evaluation of `rft_loop_sensor` in the middle of training (median of
  three); `sensor_first_tick_s`: the first in a process, which reads every materialised step
  once (later ones read only what was materialised since);
- `partition_add_s`: adding one step partition; `run_launch_s`: what a window's runs log at
  their start (run records, `dagster.steps_per_run` partitions, planned materialisations);
- `step_events_s`: logging one step's events in the long-lived runs (median of the next
  steps);
- `delta_write_s`, `delta_pin_s` (median of the next steps), `delta_open_<table>_s`,
  `ledger_update_s`, `maintenance_s`, `delta_log_files`;
- `instance_mb`: the instance's size on disk (SQLite files, or the Postgres database).
Keys carry the size (`_1k`, `_10k`, `_50k`) and, for Postgres, a `pg_` prefix; the ratios
`ratio_<size>_<smallest>_<figure>` compare each size with the smallest. Goals at 10k: each
UI query <= 2 s, a sensor tick <= 1 s, a step's events <= 50 ms, a Delta pin or write
<= 100 ms, each <= 1.5x its 1k figure (<= 3x at 50k).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from benchmarks.scale_state import REPO_ROOT, InstanceState, bench_config, grow_tables
from benchmarks.ui_capture import capture, replay
from trinity_dagster.config import CONFIG_ENV_VAR, load_config
from trinity_dagster.dagster_instance import write_instance_yaml
from trinity_dagster.local_postgres import LocalPostgres, local_postgres

PAGES = (
    "/assets/train_step",
    "/assets/train_step?view=partitions",
    "/assets/train_step?view=events",
    "/assets/train_step?view=checks",
    "/assets/checkpoint?view=partitions",
    "/assets/checkpoint?view=events",
    "/asset-groups/~/train_step",  # the asset graph's sidebar, with the metadata plots
)
FIGURES = (
    "ui_query_s",
    "sensor_tick_s",
    "sensor_first_tick_s",
    "partition_add_s",
    "run_launch_s",
    "step_events_s",
    "instance_mb",
)
DELTA_FIGURES = (
    "delta_write_s",
    "delta_pin_s",
    "delta_open_experiences_s",
    "delta_open_batches_s",
    "delta_open_ledger_steps_s",
    "ledger_update_s",
    "maintenance_s",
    "delta_log_files",
)


def label(size: int) -> str:
    """1000 -> '1k'."""
    return f"{size // 1000}k" if size % 1000 == 0 else str(size)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def webserver(home: Path, config_file: Path, log: Path) -> Iterator[str]:
    """`dagster-webserver` on the instance in `home`, on loopback; yields its base URL."""
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), CONFIG_ENV_VAR: str(config_file)}
    binary = Path(sys.executable).parent / "dagster-webserver"
    command = [str(binary), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    with open(log, "ab") as out:
        server = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/server_info", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dagster-webserver did not start; see {log}") from None
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def ui_queries(base: str) -> dict[str, float]:
    """Seconds of each GraphQL query the pages send (operation name -> slowest)."""
    seconds: dict[str, float] = {}
    for page in PAGES:
        for request in capture(base + page):
            elapsed = replay(f"{base}/graphql", request)
            seconds[request.operation] = max(elapsed, seconds.get(request.operation, 0.0))
    return seconds


def sensor_ticks(instance: Any, config_file: Path) -> tuple[float, float]:
    """Seconds of the first evaluation of `rft_loop_sensor` in a process (it reads every
    materialised step once), and the median of the next three (explorer alive)."""
    import dagster as dg

    from assets import sensors
    from assets.automation import build_rft_loop_sensor
    from assets.sensors import NewestSteps
    from resources.run_config import RunConfigResource
    from trinity_dagster.handoff.heartbeat import BUILTIN_EXPLORER_ID, Heartbeat
    from trinity_dagster.paths import RunPaths

    resource = RunConfigResource(config_path=str(config_file))
    rft_loop_sensor = build_rft_loop_sensor(resource.config.dagster)
    Heartbeat(RunPaths.of_config(resource.config), BUILTIN_EXPLORER_ID).beat(force=True)
    sensors.newest_step = NewestSteps()  # as in a code server that just started
    times = []
    for _ in range(4):
        with dg.build_sensor_context(
            instance=instance, resources={"run_config": resource}
        ) as context:
            started = time.perf_counter()
            rft_loop_sensor(context)
            times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:])


def instance_figures(
    state: InstanceState, size: int, timed: int, config_file: Path
) -> dict[str, float]:
    """Everything measured on the instance at `size` steps (the state then holds `timed` more)."""
    from assets.partitions import STEP_PARTITIONS, step_key

    instance = state.instance
    key = step_key(10**8 + size)  # beyond any step: one new partition
    started = time.perf_counter()
    instance.add_dynamic_partitions(STEP_PARTITIONS, [key])
    partition_add = time.perf_counter() - started
    instance.delete_dynamic_partition(STEP_PARTITIONS, key)
    launch = 0.0
    if state.window_due(size + 1):
        started = time.perf_counter()
        state.new_runs(size + 1)
        launch = time.perf_counter() - started
    steps = []
    for step in range(size + 1, size + timed + 1):
        started = time.perf_counter()
        state.log_step(step)
        steps.append(time.perf_counter() - started)
    first_tick, tick = sensor_ticks(instance, config_file)
    return {
        "sensor_first_tick_s": first_tick,
        "sensor_tick_s": tick,
        "partition_add_s": partition_add,
        "run_launch_s": launch,
        "step_events_s": statistics.median(steps),
    }


def directory_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,50000", help="steps, comma-separated")
    parser.add_argument("--storage", default="sqlite,postgres", help="sqlite and/or postgres")
    parser.add_argument("--timed", type=int, default=5, help="steps timed after each size")
    parser.add_argument("--no-ui", action="store_true", help="skip the webserver and Chromium")
    parser.add_argument("--keep", help="build in this directory and keep it")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    storages = args.storage.split(",")
    unknown = set(storages) - {"sqlite", "postgres"}
    if unknown:
        parser.error(f"unknown storage {sorted(unknown)}: sqlite or postgres")
    results: dict[str, Any] = {"sizes": sizes}
    with ExitStack() as stack:
        root = (
            Path(args.keep)
            if args.keep
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        )
        total = sizes[-1] + args.timed * len(sizes) + 1000
        config_file = bench_config(root / "run", total)
        os.environ[CONFIG_ENV_VAR] = str(config_file)
        config = load_config(config_file)
        states: dict[str, InstanceState] = {}
        bases: dict[str, str] = {}
        server: LocalPostgres | None = None
        for storage in storages:
            import dagster as dg

            home = root / f"dagster_home_{storage}"
            url = None
            if storage == "postgres":
                server = stack.enter_context(local_postgres())
                url = server.create_database("bench")
            write_instance_yaml(home, url, replace=True)
            instance = stack.enter_context(dg.DagsterInstance.from_config(str(home)))
            states[storage] = InstanceState(instance, config)
            if not args.no_ui:
                log = root / f"webserver_{storage}.log"
                bases[storage] = stack.enter_context(webserver(home, config_file, log))
        pool = stack.enter_context(
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        )
        built = 0
        for size in sizes:
            started = time.perf_counter()
            tables = pool.submit(grow_tables, str(config_file), built + 1, size, args.timed)
            for state in states.values():
                state.grow(size)
            delta = tables.result()
            results[f"build_s_{label(size)}"] = round(time.perf_counter() - started, 1)
            for name, value in delta.items():
                results[f"{name}_{label(size)}"] = value
            for storage, state in states.items():
                prefix = "pg_" if storage == "postgres" else ""
                figures = instance_figures(state, size, args.timed, config_file)
                if storage in bases:
                    queries = ui_queries(bases[storage])
                    slowest = max(queries, key=queries.__getitem__)
                    figures["ui_query_s"] = queries[slowest]
                    results[f"{prefix}ui_slowest_{label(size)}"] = slowest
                    results[f"{prefix}ui_queries_{label(size)}"] = {
                        name: round(value, 3) for name, value in sorted(queries.items())
                    }
                if storage == "postgres" and server is not None:
                    figures["instance_mb"] = server.database_size("bench") / 1e6
                else:
                    figures["instance_mb"] = directory_mb(root / f"dagster_home_{storage}")
                for name, value in figures.items():
                    results[f"{prefix}{name}_{label(size)}"] = value
            built = size + args.timed
            print(json.dumps({k: v for k, v in results.items() if k.endswith(label(size))}))
    base = label(sizes[0])
    for size in sizes[1:]:
        for storage in storages:
            prefix = "pg_" if storage == "postgres" else ""
            for figure in FIGURES:
                _ratio(results, f"{prefix}{figure}", label(size), base)
        for figure in DELTA_FIGURES:
            _ratio(results, figure, label(size), base)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))


def _ratio(results: dict[str, Any], figure: str, size: str, base: str) -> None:
    top, bottom = results.get(f"{figure}_{size}"), results.get(f"{figure}_{base}")
    if isinstance(top, float | int) and isinstance(bottom, float | int) and bottom > 0:
        results[f"ratio_{size}_{base}_{figure}"] = top / bottom


if __name__ == "__main__":
    main()
