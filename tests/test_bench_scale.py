"""`bench scale` at a few steps: it builds the state, captures the UI's queries from Chromium,
measures every figure on SQLite and PostgreSQL, and prints the ratios as its last line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def bench(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--sizes", "20,40", "--timed", "2", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_ui_queries_of_the_asset_pages_are_captured_and_timed() -> None:
    figures = bench("--storage", "sqlite")
    queries = figures["ui_queries_40"]
    # the asset graph's sidebar with its metadata plots, the partitions and the checks views
    for operation in ("SidebarAssetQuery", "RecentAssetEventsQuery", "PartitionHealthQuery"):
        assert operation in queries, sorted(queries)
    assert abs(figures["ui_query_s_40"] - max(queries.values())) < 0.002  # the slowest
    assert 0 < figures["step_events_s_40"] < 5 and 0 < figures["sensor_tick_s_40"] < 30
    assert figures["delta_pin_s_40"] > 0 and figures["delta_write_s_40"] > 0
    assert "ratio_40_20_step_events_s" in figures


def test_the_same_figures_are_measured_on_postgres() -> None:
    figures = bench("--storage", "postgres", "--no-ui")
    for figure in ("sensor_tick_s", "step_events_s", "partition_add_s", "instance_mb"):
        assert figures[f"pg_{figure}_40"] > 0, figure
    assert "ratio_40_20_pg_step_events_s" in figures
