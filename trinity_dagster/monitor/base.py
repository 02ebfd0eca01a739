"""`Monitor`, what every experiment-tracking backend implements, and `MonitorError`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class MonitorError(RuntimeError):
    """A tracking backend failed to start, log or close; the message names the backend."""


class Monitor(ABC):
    """One experiment-tracking backend (Trinity-RFT's `monitor_type`): it receives the
    metrics of every train step and, at the end of training, the final model."""

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of train step `step` (Trinity-RFT's names, e.g. `actor/pg_loss`)."""

    @abstractmethod
    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record a table of `rows` (same keys each) at train step `step` (a no-op where no
        tables are kept)."""

    @abstractmethod
    def log_final_model(self, hf_dir: Path) -> None:
        """Record the final model, a Hugging Face directory (a no-op where none is kept)."""

    @abstractmethod
    def close(self) -> None:
        """Write out what is buffered and release files and connections."""


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics, as floats (what scalar-only backends can record)."""
    return {name: float(value) for name, value in metrics.items() if isinstance(value, int | float)}


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """`rows` (same keys each) as a Markdown table: pipes escaped, newlines as spaces."""

    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    header = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)
