"""A tiny run trained beside the built-in explorer (the config, experiences and pinned batches
of a tiny run are in `trinity_dagster.testing`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths


@dataclass
class ExploredRun:
    """What `train_beside_explorer` saw."""

    reason: str  # why training stopped
    versions: dict[int, int]  # weights version each explore step ran with
    loop: Any  # the `ExplorerLoop`
    while_up: Any  # what the `while_up` callback returned before the service stopped


def train_beside_explorer(
    config: TrinityConfig, explored: int, while_up: Callable[[], Any] = lambda: None
) -> ExploredRun:
    """Train `config` to 3 steps with the built-in explorer loop in a thread exploring steps
    1..`explored` (then marking the end of data if that is fewer), on an engine service
    started here, so `Trainer.run` leaves it up for `while_up`; the service stops after."""
    import asyncio
    import threading

    from trinity_dagster.explorer.loop import ExplorerLoop
    from trinity_dagster.handoff.end_of_data import mark_end_of_data
    from trinity_dagster.service.launcher import start_service, stop_service
    from trinity_dagster.trainer.trainer import Trainer

    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"total_steps": 3})}
    )
    paths = RunPaths.of(config.run_root)
    versions: dict[int, int] = {}
    loop = ExplorerLoop(
        config, on_step=lambda step, meta: versions.update({step: meta["weights_version"]})
    )

    def explore() -> None:
        loop.run(1, explored)
        if explored < 3:
            mark_end_of_data(paths, "explorer-0", "test data used up")

    explorer = threading.Thread(target=explore)
    explorer.start()
    try:
        start_service(config)
        reason = asyncio.run(Trainer(config).run())
        seen = while_up()
    finally:
        explorer.join(timeout=120)
        stop_service(paths)
    return ExploredRun(reason, versions, loop, seen)
