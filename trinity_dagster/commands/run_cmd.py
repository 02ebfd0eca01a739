"""`trinity-dagster run -c CONFIG`: run a whole RFT training through Dagster for a config."""

import argparse

from trinity_dagster.commands.arguments import positive_int
from trinity_dagster.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `run`."""
    parser.add_argument("-c", "--config", required=True, help="YAML run configuration")
    parser.add_argument("--root", help="run root directory (overrides run_root)")
    parser.add_argument(
        "--workspace", help="the Dagster workspace.yaml (default: ./workspace.yaml, the repo's)"
    )
    parser.add_argument(
        "--steps", type=positive_int, help="train steps (overrides trainer.total_steps)"
    )


def main(args: argparse.Namespace) -> int:
    """Train to `trainer.total_steps` and print the summary."""
    from trinity_dagster.commands.training_run import run_training

    overrides = {}
    if args.root:
        overrides["run_root"] = args.root
    if args.steps is not None:
        overrides["trainer.total_steps"] = args.steps
    config = load_config(args.config, overrides=overrides)
    run_training(config, args.workspace)
    return 0
