"""`trinity-dagster config show -c FILE`: print the resolved configuration."""

from __future__ import annotations

import argparse

from trinity_dagster.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `config show`."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved configuration as YAML")
    show.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")


def main(args: argparse.Namespace) -> int:
    """Print the configuration with every default filled in and paths resolved."""
    cfg = load_config(args.config)
    print(cfg.to_yaml(), end="")
    return 0
