"""`trinity-dagster config show -c FILE`: check the inputs, print the resolved configuration."""

from __future__ import annotations

import argparse

import yaml

from trinity_dagster.config import check_inputs, load_config
from trinity_dagster.trinity_keys import trinity_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `config show`."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="check the input paths, print the resolved configuration as YAML"
    )
    show.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")


def main(args: argparse.Namespace) -> int:
    """Print the configuration with every default filled in and paths resolved, once its
    input files and directories are found; a key this project only renames from Trinity-RFT's
    is printed under Trinity's name."""
    cfg = load_config(args.config)
    check_inputs(cfg)
    print(yaml.safe_dump(trinity_names(cfg.model_dump(mode="json")), sort_keys=False), end="")
    return 0
