"""`trinity-dagster demo [--root DIR] [--steps N]`: the end-to-end training demo.

A tiny Llama-style model learns integer arithmetic on CPU: SFT on generated demonstrations,
then GRPO on its own rollouts, all through the Dagster graph, with every artefact under DIR.
"""

import argparse

from trinity_dagster.commands.arguments import positive_int
from trinity_dagster.config import DEFAULT_RUN_ROOT, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `demo`."""
    parser.add_argument("--root", default=DEFAULT_RUN_ROOT, help="run root directory")
    parser.add_argument(
        "--workspace", help="the Dagster workspace.yaml (default: ./workspace.yaml, the repo's)"
    )
    parser.add_argument("--steps", type=positive_int, help="train steps (default: the demo's)")
    parser.add_argument("--seed", type=int, help="trainer and explorer seed")


def main(args: argparse.Namespace) -> int:
    """Run the demo on the embedded defaults and print the summary."""
    from trinity_dagster.commands.training_run import run_training

    overrides: dict[str, object] = {"run_root": args.root}
    if args.steps is not None:
        overrides["trainer.total_steps"] = args.steps
    if args.seed is not None:
        overrides["trainer.seed"] = args.seed
        overrides["explorer.seed"] = args.seed
    run_training(load_config(None, overrides=overrides), args.workspace)
    return 0
