"""Shared builders for the buffer tests (no tests here)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.testing import config_at

BUFFER_RUN: dict[str, Any] = {
    "algorithm": {"repeat_times": 2},
    "buffer": {"train_batch_size": 4, "batch_unit": "rows"},
    "trainer": {"micro_batch_size": 1},
}


def buffer_config(root: Path, **buffer: Any) -> TrinityConfig:
    """A config rooted at `root` with groups of 2 (`repeat_times`) and the given buffer keys."""
    overrides = {f"buffer.{key}": value for key, value in buffer.items() if key != "repeat_times"}
    if "repeat_times" in buffer:
        overrides["algorithm.repeat_times"] = buffer["repeat_times"]
    return config_at(root, BUFFER_RUN, overrides)


def make_row(
    eid: str,
    group: str = "g",
    version: int = 0,
    prompt: int = 3,
    response: int = 2,
    reward: float = 1.0,
    **extra: Any,
) -> dict[str, Any]:
    """A valid experience row with `prompt` + `response` tokens."""
    row = {
        "eid": eid,
        "task_id": f"task-{group}",
        "group_id": group,
        "explorer_id": "ex0",
        "tokens": list(range(1, prompt + response + 1)),
        "prompt_length": prompt,
        "action_mask": [True] * response,
        "logprobs": [-0.5] * response,
        "reward": reward,
        "model_version": version,
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "info": "{}",
    }
    row.update(extra)
    return row


def make_rows(prefix: str, n: int, group_size: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    """`n` valid rows; consecutive `group_size` rows share a group id."""
    return [
        make_row(f"{prefix}-{i}", group=f"{prefix}-g{i // group_size}", **kwargs) for i in range(n)
    ]
