"""Reading the pinned batch of a step, and turning it into padded training tensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable

from trinity_dagster.buffer.schema import EXPERIENCE_NAMES
from trinity_dagster.buffer.tables import HeldTable, table_dataset
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths

if TYPE_CHECKING:
    import torch


class StepNotPinnedError(LookupError):
    """The batches table holds no rows for the requested step."""


def _paths(paths_or_config: RunPaths | TrinityConfig | str | Path) -> RunPaths:
    if isinstance(paths_or_config, RunPaths):
        return paths_or_config
    if isinstance(paths_or_config, TrinityConfig):
        return RunPaths.of_config(paths_or_config)
    return RunPaths.of(paths_or_config)


def load_step_batch(paths_or_config: RunPaths | TrinityConfig | str | Path, step: int) -> pa.Table:
    """The experience rows pinned to train `step`, in pinned order (experience schema)."""
    return StepBatches(_paths(paths_or_config)).load(step)


class StepBatches:
    """Reads the pinned batches of one run, keeping the `batches` table open between reads
    (`HeldTable`)."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self._batches = HeldTable(paths.batches)

    def load(self, step: int) -> pa.Table:
        """What `load_step_batch` returns."""
        batches = self._batches.get()
        if batches is None:
            raise StepNotPinnedError(
                f"step {step} is not pinned: no batches table at {self.paths.batches}"
            )
        rows = _step_train_rows(batches, step)
        if rows.num_rows == 0:
            raise StepNotPinnedError(f"step {step} is not pinned in {self.paths.batches}")
        return rows.sort_by("position").select(list(EXPERIENCE_NAMES))


def _step_train_rows(batches: DeltaTable, step: int) -> pa.Table:
    """The train rows of `step`, read from the data files whose `step` statistics admit it
    (a pin is one commit, so one file; a compacted table may spread steps over a few)."""
    condition = (ds.field("step") == step) & (ds.field("kind") == "train")
    return table_dataset(batches, "step", step, step).to_table(filter=condition)


def _aligned(
    values: list[list[float] | None], prompts: np.ndarray, shape: tuple[int, int], dtype: type
) -> np.ndarray:
    """Per-response-token values placed at the positions of their tokens."""
    out: np.ndarray = np.zeros(shape, dtype=dtype)
    for i, row in enumerate(values):
        if row:
            out[i, prompts[i] : prompts[i] + len(row)] = row
    return out


def to_tensors(table: pa.Table, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded training tensors of a batch (see docs/buffer.md for each key)."""
    import torch

    if table.num_rows == 0:
        raise ValueError("to_tensors: the batch is empty")
    tokens = table.column("tokens").to_pylist()
    prompts = np.asarray(table.column("prompt_length").to_pylist(), dtype=np.int64)
    lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)
    width = int(lengths.max())
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(
                f"to_tensors: pad_to {pad_to} is shorter than the longest row ({width})"
            )
        width = pad_to
    shape = (table.num_rows, width)
    token_ids = np.zeros(shape, dtype=np.int64)
    for i, row in enumerate(tokens):
        token_ids[i, : len(row)] = row
    groups = table.column("group_id").to_pylist()
    dense: dict[str, int] = {}
    out = {
        "tokens": torch.from_numpy(token_ids),
        "attention_mask": torch.from_numpy(np.arange(width)[None, :] < lengths[:, None]),
        "response_mask": torch.from_numpy(
            _aligned(table.column("action_mask").to_pylist(), prompts, shape, np.bool_)
        ),
        "old_logprobs": torch.from_numpy(
            _aligned(table.column("logprobs").to_pylist(), prompts, shape, np.float32)
        ),
        "rewards": torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32),
        "group_index": torch.tensor(
            [dense.setdefault(g, len(dense)) for g in groups], dtype=torch.int64
        ),
        "model_version": torch.tensor(table.column("model_version").to_pylist(), dtype=torch.int64),
    }
    for name in ("advantages", "returns"):
        values = table.column(name).to_pylist()
        if all(v is not None for v in values):
            out[name] = torch.from_numpy(_aligned(values, prompts, shape, np.float32))
    return out
