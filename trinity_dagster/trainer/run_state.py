"""The trainer's run state (`logs/trainer_state.json`): running, finished or failed, and why.

The trainer loop writes it; explorers read it while they wait for weights (a stopped trainer
will publish none), the sensors read it to know whether to start a trainer run, and the
`run` command reads it for the summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths

State = Literal["running", "finished", "failed"]
STATE_FILE = "trainer_state.json"
DATA_ENDED = "data ended"


@dataclass(frozen=True)
class TrainerState:
    """Where the trainer loop stands: `state`, the step it reached and why it stopped."""

    state: State
    step: int
    reason: str = ""
    updated_at: float = 0.0

    def finished(self, total_steps: int) -> bool:
        """Whether training of a run with `total_steps` is over (all steps, or data ended)."""
        return self.state == "finished" and (
            self.step >= total_steps or self.reason.startswith(DATA_ENDED)
        )


def state_path(paths: RunPaths) -> Path:
    """The state file of the run rooted at `paths`."""
    return paths.logs / STATE_FILE


def write_trainer_state(paths: RunPaths, state: State, step: int, reason: str = "") -> None:
    """Record the trainer's state (atomically)."""
    record = TrainerState(state, step, reason, time.time())
    write_text_atomic(state_path(paths), json.dumps(asdict(record)))


def read_trainer_state(paths: RunPaths) -> TrainerState | None:
    """The recorded state, or None before the trainer first ran."""
    try:
        return TrainerState(**json.loads(state_path(paths).read_text()))
    except FileNotFoundError:
        return None
