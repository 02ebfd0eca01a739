"""`trinity-dagster engine start|status|stop|join|recipe -c CONFIG`: the engine service by hand.

`start`, `status` and `stop` manage the run's service; `join --node-rank K` runs another
node's agent of an N-node service in the foreground; `recipe slurm|k8s` prints a launch
recipe of the N-node service for a scheduler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trinity_dagster.config import TrinityConfig

if TYPE_CHECKING:
    from trinity_dagster.service.launcher import SilentService

MANAGE = ("start", "status", "stop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `engine start|status|stop|join|recipe`."""
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")
    config_file = argparse.ArgumentParser(add_help=False)
    config_file.add_argument("-c", "--config", required=True, help="YAML file every node loads")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_text in zip(
        MANAGE,
        ("start the service, or attach to it", "report on the service", "stop the service"),
        strict=True,
    ):
        actions.add_parser(action, parents=[config], help=help_text, description=help_text)
    join = actions.add_parser(
        "join",
        parents=[config_file],
        help="run this node's agent of an N-node service (foreground)",
        description="Run this node's torchrun agent of an N-node engine service in the "
        "foreground, until the service stops.",
    )
    join.add_argument(
        "--node-rank",
        type=int,
        help="this node's index; 0 hosts the rendezvous (default: service.node_rank)",
    )
    recipe = actions.add_parser(
        "recipe",
        parents=[config_file],
        help="print a Slurm or Kubernetes launch recipe of the N-node service",
        description="Print a Slurm sbatch script or a Kubernetes manifest that starts the "
        "N-node engine service of the configuration.",
    )
    recipe.add_argument("scheduler", choices=["slurm", "k8s"])
    recipe.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs each node requests (default: its ranks, service.nproc_per_node; 0: none)",
    )
    recipe.add_argument("--image", default="trinity-dagster:latest", help="k8s: container image")
    recipe.add_argument(
        "--runs-claim",
        default="trinity-dagster-runs",
        help="k8s: PersistentVolumeClaim mounted at the run root",
    )


def main(args: argparse.Namespace) -> int:
    """Run one engine action."""
    from trinity_dagster.config import load_config

    config = load_config(args.config)
    if args.action == "join":
        from trinity_dagster.service.launcher import join_service

        return join_service(config, Path(args.config), args.node_rank)
    if args.action == "recipe":
        print(_recipe(args, config), end="")
        return 0
    return _manage(args.action, config)


def _recipe(args: argparse.Namespace, config: TrinityConfig) -> str:
    """The launch recipe the arguments ask for."""
    from trinity_dagster.service.recipes import RecipeOptions, recipe

    world_size = config.megatron.world_size
    gpus = args.gpus_per_node
    options = RecipeOptions(
        gpus_per_node=config.service.procs_per_node(world_size) if gpus is None else gpus,
        image=args.image,
        runs_claim=args.runs_claim,
    )
    return recipe(args.scheduler, config, Path(args.config), options)


def _manage(action: str, config: TrinityConfig) -> int:
    """Start (or attach to), report on, or stop the run's engine service."""
    from trinity_dagster.paths import RunPaths
    from trinity_dagster.service.launcher import (
        SilentService,
        connect,
        find_service,
        replace_silent,
        stop_service,
    )
    from trinity_dagster.service.owner import owner_report

    paths = RunPaths.of_config(config)
    if action == "stop":
        stopped = stop_service(paths)
        print("engine service stopped" if stopped else f"no engine service for {paths.root}")
        return 0
    found = find_service(paths)
    if isinstance(found, SilentService):
        if action == "status":
            _report_silent(found, paths.root)
            return 1
        killed = replace_silent(paths, found)
        print(
            f"the engine service of {paths.root} did not answer ({found.reason}); "
            f"killed its processes {killed} and starting a new one",
            file=sys.stderr,
        )
    elif found is None and action == "status":
        print(json.dumps({"running": False, "run_root": str(paths.root)}))
        return 1
    with connect(config, autostart=action == "start") as client:
        report = {"running": True, "url": client.url, **client.status()}
        print(json.dumps({**report, "owner": owner_report(paths)}, indent=1))
    return 0


def _report_silent(silent: SilentService, root: Path) -> None:
    """Tell the user that the service exists but does not answer, and what to do."""
    report = {"running": False, "answering": False, "pid": silent.state.pid}
    print(json.dumps({**report, "reason": silent.reason}))
    print(
        f"the engine service of {root} (rank 0 pid {silent.state.pid}) does not answer: "
        f"{silent.reason}; `trinity-dagster engine start` replaces it, "
        "`trinity-dagster engine stop` kills it",
        file=sys.stderr,
    )
