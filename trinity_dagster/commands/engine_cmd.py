"""`trinity-dagster engine start|status|stop -c CONFIG`: manage the engine service by hand."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `engine start|status|stop`."""
    parser.add_argument("action", choices=["start", "status", "stop"])
    parser.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")


def main(args: argparse.Namespace) -> int:
    """Start (or attach to), report on, or stop the run's engine service."""
    from trinity_dagster.config import load_config
    from trinity_dagster.paths import RunPaths
    from trinity_dagster.service.launcher import connect, live_service, stop_service

    config = load_config(args.config)
    paths = RunPaths.of(config.run_root)
    if args.action == "stop":
        stopped = stop_service(paths)
        print("engine service stopped" if stopped else f"no engine service for {paths.root}")
        return 0
    if args.action == "status" and live_service(paths) is None:
        print(json.dumps({"running": False, "run_root": str(paths.root)}))
        return 1
    with connect(config, autostart=args.action == "start") as client:
        print(json.dumps({"running": True, "url": client.url, **client.status()}, indent=1))
    return 0
