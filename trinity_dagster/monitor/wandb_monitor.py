"""The `wandb` backend: each train step's metrics, the rollout preview and the final model in a
Weights & Biases run; offline by default, kept under `<run_root>/logs/wandb/`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast, get_args

import wandb

from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.monitor.base import Monitor, scalars
from trinity_dagster.paths import RunPaths

MODEL_ARTIFACT = "model"


def wandb_dir(paths: RunPaths) -> Path:
    """The directory W&B is given for the run rooted at `paths`; it keeps its runs in the
    `wandb/` folder there."""
    return paths.logs


WandbMode = Literal["offline", "online", "disabled"]


def _mode(configured: str | None) -> WandbMode:
    """`monitor.wandb_mode`, else the environment's WANDB_MODE, else offline."""
    mode = configured or os.environ.get("WANDB_MODE") or "offline"
    if mode not in get_args(WandbMode):
        raise ValueError(f"WANDB_MODE={mode!r}: expected one of {', '.join(get_args(WandbMode))}")
    return cast(WandbMode, mode)


class WandbMonitor(Monitor):
    """One W&B run per start of the trainer, in the project named by `project`."""

    def __init__(self, config: TrinityConfig) -> None:
        self._paths = RunPaths.of_config(config)
        wandb_dir(self._paths).mkdir(parents=True, exist_ok=True)
        # staged artifacts and W&B's cache stay under the run root unless placed elsewhere
        for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
            os.environ.setdefault(name, str(wandb_dir(self._paths) / "wandb" / "local"))
        monitor = config.monitor
        settings = wandb.Settings(
            console="off",  # the run's own log files keep the output
            x_disable_stats=True,  # no system-metrics sampler beside training
        )
        if monitor.wandb_base_url:
            settings.base_url = monitor.wandb_base_url
        self._run = wandb.init(
            project=config.project,
            name=config.name,
            dir=str(wandb_dir(self._paths)),
            mode=_mode(monitor.wandb_mode),
            config=config.model_dump(mode="json"),
            tags=["trainer"],
            settings=settings,
        )
        self.run_dir = Path(self._run.dir).parent

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(scalars(metrics), step=step)

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns = list(rows[0]) if rows else []
        data = [[row[c] for c in columns] for row in rows]
        table = wandb.Table(columns=list[str | int](columns), data=data)
        self._run.log({name: table}, step=step)

    def log_final_model(self, hf_dir: Path) -> None:
        """Log the HF directory as the run's model artifact `model`."""
        if not hf_dir_written(hf_dir):
            raise FileNotFoundError(f"no final HF model to log: {hf_dir} has no config.json")
        artifact = wandb.Artifact(MODEL_ARTIFACT, type="model")
        artifact.add_dir(str(hf_dir))
        self._run.log_artifact(artifact)

    def close(self) -> None:
        """Finish the W&B run: exit code 1 when the trainer failed, 0 otherwise."""
        state = read_trainer_state(self._paths)
        self._run.finish(exit_code=1 if state is not None and state.state == "failed" else 0)
