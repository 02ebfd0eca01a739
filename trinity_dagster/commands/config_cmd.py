"""`trinity-dagster config show -c FILE`: check the inputs, print the resolved configuration."""

from __future__ import annotations

import argparse

from trinity_dagster.config import check_inputs, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `config show`."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="check the input paths, print the resolved configuration as YAML"
    )
    show.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")


def main(args: argparse.Namespace) -> int:
    """Print the configuration with every default filled in and paths resolved, once its
    input files and directories are found."""
    cfg = load_config(args.config)
    check_inputs(cfg)
    print(cfg.to_yaml(), end="")
    return 0
