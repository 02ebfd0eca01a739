"""Trinity-RFT's rollout preview (`trainer.enable_preview`): the lowest- and highest-reward
experience of each step's batch as text, logged every `synchronizer.sync_interval` steps as
the table `rollout_examples` (columns step, prompt, response, reward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

from trinity_dagster.buffer.sampler import PinResult, pinned_columns
from trinity_dagster.paths import RunPaths

TABLE = "rollout_examples"
_COLUMNS = ["tokens", "prompt_length", "reward"]


class RolloutPreview:
    """Collects each step's representative rows until the table is logged."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self.pending: list[dict[str, Any]] = []
        self._decode: Callable[[list[int]], str] | None = None

    def add(self, batch: PinResult) -> None:
        """Add the lowest- and highest-reward rows of `batch` (read back if pinned before)."""
        rows = (
            batch.rows.select(_COLUMNS)
            if batch.rows is not None
            else pinned_columns(self.paths, batch.step, _COLUMNS)
        )
        self.pending += representative(batch.step, rows, self.decoder())

    def take(self) -> list[dict[str, Any]]:
        """The rows collected since the last call."""
        rows, self.pending = self.pending, []
        return rows

    def decoder(self) -> Callable[[list[int]], str]:
        """Token ids to text with the run's tokenizer (`tokenizer.json`), or the ids as
        text when the tokenizer has none."""
        if self._decode is None:
            file = self.paths.tokenizer / "tokenizer.json"
            if file.is_file():
                tokenizer = Tokenizer.from_file(str(file))
                self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            else:
                self._decode = lambda ids: " ".join(map(str, ids))
        return self._decode


def representative(
    step: int, rows: pa.Table, decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """The lowest- and highest-reward row of `rows` as {step, prompt, response, reward}."""
    if rows.num_rows == 0:
        return []
    rewards = rows.column("reward")
    picks = [pc.index(rewards, pc.min(rewards)).as_py(), pc.index(rewards, pc.max(rewards)).as_py()]
    out = []
    for i in picks:
        tokens = rows.column("tokens")[i].as_py()
        split = rows.column("prompt_length")[i].as_py()
        out.append(
            {
                "step": step,
                "prompt": decode(tokens[:split]),
                "response": decode(tokens[split:]),
                "reward": rewards[i].as_py(),
            }
        )
    return out
