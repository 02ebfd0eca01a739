"""Where everything of a run lives under its run root."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The fixed layout of a run root directory."""

    root: Path

    @classmethod
    def of(cls, run_root: str | Path) -> RunPaths:
        """The layout for `run_root`."""
        return cls(Path(run_root))

    @property
    def dagster_home(self) -> Path:
        """The Dagster instance (SQLite storage) of this run."""
        return self.root / "dagster_home"

    @property
    def experiences(self) -> Path:
        """Delta table that explorers append experiences to."""
        return self.root / "experiences"

    @property
    def batches(self) -> Path:
        """Delta table of the experiences pinned to each train step."""
        return self.root / "batches"

    @property
    def quarantine(self) -> Path:
        """Delta table of rejected experiences with the reason."""
        return self.root / "quarantine"

    @property
    def checkpoints(self) -> Path:
        """Full checkpoints: `global_step_N/` and the `latest_*.txt` markers."""
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        """Weights published to explorers (HF format), one directory per version."""
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        """Service logs and metrics files."""
        return self.root / "logs"

    @property
    def service(self) -> Path:
        """Engine service state: token, pid and port files."""
        return self.root / "service"

    @property
    def tokenizer(self) -> Path:
        """The tokenizer (HF format) shared by the model, explorers and exports."""
        return self.root / "tokenizer"
