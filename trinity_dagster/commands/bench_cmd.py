"""`trinity-dagster bench NAME`: run `benchmarks/bench_NAME.py` of a checkout.

The benchmarks are not part of the installed package: they live in the repository and run
as `python -m benchmarks.bench_NAME` from its root (the current directory, or `--repo`).
Each measures against a baseline in the same run and prints, as its last line, one JSON
object with its figures and ratios.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


class BenchmarkNotFoundError(LookupError):
    """No `benchmarks/` in the checkout, or no benchmark of that name; the message says which."""


def benchmarks_dir(repo: str | Path | None) -> Path:
    """The `benchmarks/` directory of the checkout at `repo` (default: the current directory)."""
    root = Path(repo) if repo else Path.cwd()
    found = root.resolve() / "benchmarks"
    if not found.is_dir():
        raise BenchmarkNotFoundError(
            f"no benchmarks/ in {root.resolve()}: run from the trinity-dagster repository "
            "root or pass --repo PATH (benchmarks are not installed with the package)"
        )
    return found


def available(directory: Path) -> list[str]:
    """Names of the benchmarks in `directory`."""
    return sorted(p.stem.removeprefix("bench_") for p in directory.glob("bench_*.py"))


def benchmark_command(directory: Path, name: str, bench_args: list[str]) -> list[str]:
    """The command that runs benchmark `name` as a module, from the checkout's root."""
    if not (directory / f"bench_{name}.py").is_file():
        raise BenchmarkNotFoundError(
            f"no benchmark {name!r} in {directory} "
            f"(available: {', '.join(available(directory)) or 'none'})"
        )
    return [sys.executable, "-m", f"benchmarks.bench_{name}", *bench_args]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `bench [--repo PATH] NAME [ARGS...]`."""
    parser.add_argument(
        "--repo", help="the trinity-dagster checkout holding benchmarks/ (default: the cwd)"
    )
    parser.add_argument("name", help="the benchmark: benchmarks/bench_NAME.py")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")


def main(args: argparse.Namespace) -> int:
    """Run one benchmark with its own arguments; its exit status is the command's."""
    try:
        directory = benchmarks_dir(args.repo)
        command = benchmark_command(directory, args.name, args.bench_args)
    except BenchmarkNotFoundError as err:
        print(f"trinity-dagster: {err}", file=sys.stderr)
        return 2
    return subprocess.run(command, cwd=directory.parent).returncode
