"""The `trinity-dagster` command.

Each subcommand lives in its own module under `trinity_dagster.commands`, which provides
`add_arguments(parser)` and `main(args) -> int`. Command modules import nothing heavy at
module level (torch, megatron, dagster load inside `main`), so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from trinity_dagster.commands.daemon_control import restore_stop_signals
from trinity_dagster.commands.errors import StoppedBySignal, TrainingRunError
from trinity_dagster.config import ConfigError

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("trinity_dagster.commands.demo_cmd", "run the end-to-end training demo"),
    "run": ("trinity_dagster.commands.run_cmd", "run a whole training for a config"),
    "config": ("trinity_dagster.commands.config_cmd", "show the resolved configuration"),
    "bench": ("trinity_dagster.commands.bench_cmd", "run a benchmark from benchmarks/"),
    "convert": ("trinity_dagster.commands.convert_cmd", "turn a full checkpoint into an HF dir"),
    "lineage": (
        "trinity_dagster.commands.lineage_cmd",
        "what trained what: a checkpoint's steps, an experience's step, a weights version's use",
    ),
    "engine": (
        "trinity_dagster.commands.engine_cmd",
        "start, inspect, stop or join the engine service; print launch recipes",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="trinity-dagster",
        description="Reinforcement fine-tuning as a Dagster asset graph.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    restore_stop_signals()
    try:
        return int(args._main(args) or 0)
    except ConfigError as err:
        print(f"trinity-dagster: {err}", file=sys.stderr)
        return 2
    except TrainingRunError as err:  # the message names the cause; a traceback adds nothing
        print(f"trinity-dagster: {err}", file=sys.stderr)
        return 1
    except StoppedBySignal as err:  # what the command started is stopped by now
        print(f"trinity-dagster: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
