"""The backends by name (`monitor.backends`), and `MonitorGroup`, which fans out to them.

A backend's module is imported only when a run names it, so a run without `mlflow` or
`tensorboard` imports neither.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.monitor.base import Monitor, MonitorError

# name -> (module, class): every name `MonitorConfig.backends` accepts
BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("trinity_dagster.monitor.tensorboard_monitor", "TensorBoardMonitor"),
    "mlflow": ("trinity_dagster.monitor.mlflow_monitor", "MlflowMonitor"),
    "jsonl": ("trinity_dagster.monitor.jsonl_monitor", "JsonlMonitor"),
    "wandb": ("trinity_dagster.monitor.wandb_monitor", "WandbMonitor"),
}


@contextmanager
def _named(name: str, action: str) -> Iterator[None]:
    """Turn a backend's error into a `MonitorError` that names the backend and the action."""
    try:
        yield
    except Exception as err:
        raise MonitorError(
            f"monitor backend {name!r} (monitor.backends) failed to {action}: "
            f"{type(err).__name__}: {err}"
        ) from err


class MonitorGroup(Monitor):
    """The configured backends as one `Monitor`: every call reaches each, in order."""

    def __init__(self, backends: Mapping[str, Monitor]) -> None:
        self.backends = dict(backends)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, backend in self.backends.items():
            with _named(name, f"log the metrics of step {step}"):
                backend.log(step, metrics)

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        for backend_name, backend in self.backends.items():
            with _named(backend_name, f"log the table {name} of step {step}"):
                backend.log_table(name, step, rows)

    def log_final_model(self, hf_dir: Path) -> None:
        for name, backend in self.backends.items():
            with _named(name, f"log the final model {hf_dir}"):
                backend.log_final_model(hf_dir)

    def close(self) -> None:
        """Close every backend, also after one failed to (that failure is raised)."""
        with ExitStack() as stack:
            for name, backend in self.backends.items():
                stack.callback(_close, name, backend.close)


def _close(name: str, close: Callable[[], None]) -> None:
    with _named(name, "close"):
        close()


def open_monitor(config: TrinityConfig) -> MonitorGroup:
    """Start the backends of `monitor.backends`; raises `MonitorError` naming one that fails
    (the ones started before it are closed again)."""
    started: dict[str, Monitor] = {}
    with ExitStack() as stack:
        for name in config.monitor.backends:
            started[name] = _start(name, config)
            stack.callback(_close, name, started[name].close)
        stack.pop_all()
    return MonitorGroup(started)


def _start(name: str, config: TrinityConfig) -> Monitor:
    module, cls = BACKENDS[name]
    # a training run sends nothing over the network unless the user asks for it
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    with _named(name, "start"):
        backend: Monitor = getattr(importlib.import_module(module), cls)(config)
    return backend
