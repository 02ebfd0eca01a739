"""Trinity-RFT's trainer API: `Trainer`, `TrainEngineWrapper`, `get_trainer_wrapper`,
`CheckpointMonitor` (see docs/design.md for how each maps onto the Dagster graph)."""

from trinity_dagster.checkpoint.markers import CheckpointMonitor
from trinity_dagster.trainer.engine_wrapper import (
    ServiceEngineWrapper,
    TrainEngineWrapper,
    get_trainer_wrapper,
)
from trinity_dagster.trainer.trainer import SyncWithheldError, Trainer, TrainerHook

__all__ = [
    "CheckpointMonitor",
    "ServiceEngineWrapper",
    "SyncWithheldError",
    "TrainEngineWrapper",
    "Trainer",
    "TrainerHook",
    "get_trainer_wrapper",
]
