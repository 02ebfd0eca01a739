"""`trinity-dagster bench NAME`: run `benchmarks/bench_NAME.py` of this checkout.

Each benchmark measures against a baseline in the same run and prints, as its last line,
one JSON object with its figures and ratios.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def available() -> list[str]:
    """Names of the benchmarks in `benchmarks/`."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCHMARKS_DIR.glob("bench_*.py"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `bench NAME [ARGS...]`."""
    parser.add_argument("name", help="benchmark name: " + ", ".join(available()))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")


def main(args: argparse.Namespace) -> int:
    """Run one benchmark as `__main__`, with its own arguments."""
    script = BENCHMARKS_DIR / f"bench_{args.name}.py"
    if not script.is_file():
        print(
            f"trinity-dagster: no benchmark {args.name!r} in {BENCHMARKS_DIR} "
            f"(available: {', '.join(available()) or 'none'})",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0
