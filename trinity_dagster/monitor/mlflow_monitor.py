"""The `mlflow` backend: one MLflow run per trainer start, in the experiment `project`.

By default the tracking store is SQLite under the run root (`logs/mlflow/mlflow.db`, the
artifacts beside it); `monitor.mlflow_tracking_uri` names another store or a server. The run
is named after `name` and tagged with the run root; its params are the flattened
configuration, its metrics every step's, its artifact `model` the final HF export.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.monitor.base import Monitor, scalars
from trinity_dagster.paths import RunPaths

RUN_ROOT_TAG = "trinity_dagster.run_root"
MODEL_ARTIFACT = "model"


def mlflow_dir(paths: RunPaths) -> Path:
    """The default MLflow store of the run rooted at `paths`: `mlflow.db` and `artifacts/`."""
    return paths.mlflow


def flat_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as MLflow params: dotted key paths (`trainer.total_steps`) to text."""
    params: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


class MlflowMonitor(Monitor):
    """Logs the run to an MLflow tracking store."""

    def __init__(self, config: TrinityConfig) -> None:
        self._paths = RunPaths.of_config(config)
        uri = config.monitor.mlflow_tracking_uri
        artifact_location = None
        if uri is None:
            store = mlflow_dir(self._paths).resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
            artifact_location = (store / "artifacts").as_uri()
        self._client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(config.project, artifact_location)
        run = self._client.create_run(
            experiment_id, run_name=config.name, tags={RUN_ROOT_TAG: str(self._paths.root)}
        )
        self.run_id: str = run.info.run_id
        self._tables: dict[str, list[dict[str, Any]]] = {}
        params = flat_params(config.model_dump(mode="json"))
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return self._client.create_experiment(name, artifact_location=artifact_location)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        timestamp = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(k, v, timestamp, step) for k, v in scalars(metrics).items()],
        )

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """The artifact `<name>.json` in MLflow's table format (`columns`, `data`), holding
        every row this run logged to it so far (as `mlflow.log_table` appends)."""
        table = self._tables.setdefault(name, [])
        table += [dict(row) for row in rows]
        columns = list(table[0]) if table else []
        data = {"columns": columns, "data": [[row[c] for c in columns] for row in table]}
        self._client.log_dict(self.run_id, data, artifact_file=f"{name}.json")

    def log_final_model(self, hf_dir: Path) -> None:
        """Log the HF directory as the run's artifact `model`."""
        if not hf_dir_written(hf_dir):
            raise FileNotFoundError(f"no final HF model to log: {hf_dir} has no config.json")
        self._client.log_artifacts(self.run_id, str(hf_dir), artifact_path=MODEL_ARTIFACT)

    def close(self) -> None:
        """End the MLflow run: FAILED when the trainer failed, FINISHED otherwise."""
        state = read_trainer_state(self._paths)
        failed = state is not None and state.state == "failed"
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
