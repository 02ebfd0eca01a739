"""`trinity-dagster engine start|status|stop -c CONFIG`: manage the engine service by hand."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trinity_dagster.service.launcher import SilentService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `engine start|status|stop`."""
    parser.add_argument("action", choices=["start", "status", "stop"])
    parser.add_argument("-c", "--config", help="YAML file; omitted: the embedded demo defaults")


def main(args: argparse.Namespace) -> int:
    """Start (or attach to), report on, or stop the run's engine service."""
    from trinity_dagster.config import load_config
    from trinity_dagster.paths import RunPaths
    from trinity_dagster.service.launcher import (
        SilentService,
        connect,
        find_service,
        replace_silent,
        stop_service,
    )

    config = load_config(args.config)
    paths = RunPaths.of(config.run_root)
    if args.action == "stop":
        stopped = stop_service(paths)
        print("engine service stopped" if stopped else f"no engine service for {paths.root}")
        return 0
    found = find_service(paths)
    if isinstance(found, SilentService):
        if args.action == "status":
            _report_silent(found, paths.root)
            return 1
        killed = replace_silent(paths, found)
        print(
            f"the engine service of {paths.root} did not answer ({found.reason}); "
            f"killed its processes {killed} and starting a new one",
            file=sys.stderr,
        )
    elif found is None and args.action == "status":
        print(json.dumps({"running": False, "run_root": str(paths.root)}))
        return 1
    with connect(config, autostart=args.action == "start") as client:
        print(json.dumps({"running": True, "url": client.url, **client.status()}, indent=1))
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
