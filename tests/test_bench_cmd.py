"""`trinity-dagster bench`: runs a benchmark of the checkout in the cwd or given by `--repo`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trinity_dagster.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_without_a_checkout_it_names_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "buffer", "--help"]) == 2
    error = capsys.readouterr().err
    assert f"no benchmarks/ in {tmp_path.resolve()}" in error
    assert "--repo" in error


def test_an_unknown_benchmark_lists_the_available_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--repo", str(REPO), "nope"]) == 2
    error = capsys.readouterr().err
    assert f"no benchmark 'nope' in {REPO / 'benchmarks'}" in error
    assert "buffer" in error and "daemon" in error


def test_runs_the_benchmark_of_the_given_checkout_as_a_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--repo", str(REPO), "buffer", "--help"]) == 0
    assert "--pins" in capfd.readouterr().out


def test_a_failing_benchmark_fails_the_command(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--repo", str(REPO), "buffer", "--no-such-option"]) == 2
    assert "unrecognized arguments: --no-such-option" in capfd.readouterr().err


def test_bench_sync_times_every_method_and_checks_what_arrived(
    capfd: pytest.CaptureFixture[str],
) -> None:
    args = ["bench", "--repo", str(REPO), "sync", "--shapes", "demo", "--repeats", "1"]
    assert main([*args, "--warmup", "0"]) == 0
    figures = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    for method in ("checkpoint", "memory", "nccl", "raw_broadcast"):
        assert figures[f"demo_{method}_s"] > 0, method
    assert figures["demo_nccl_bytes"] == figures["demo_bytes"] > 0
    assert figures["demo_nccl_vs_raw_broadcast_ratio"] > 0
