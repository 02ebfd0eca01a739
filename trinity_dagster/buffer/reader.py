"""Reading the pinned batch of a step, and turning it into padded training tensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from deltalake import DeltaTable

from trinity_dagster.buffer.schema import EXPERIENCE_NAMES, PIN_STEP_KEY
from trinity_dagster.buffer.tables import HeldTable, read_commit, table_dataset
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths, local_path

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

    def load(self, step: int, pin_version: int | None = None) -> pa.Table:
        """What `load_step_batch` returns.

        `pin_version`, the `batches` commit that pinned the step if the caller knows it, lets
        the rows come from the files that commit added (one parquet file, no log to read);
        without it, or if that commit is not the step's pin, the table is scanned.
        """
        if pin_version is not None:
            rows = rows_of_pin(self.paths.batches, step, pin_version)
            if rows is not None:
                return rows
        batches = self._batches.get()
        if batches is None:
            raise StepNotPinnedError(
                f"step {step} is not pinned: no batches table at {self.paths.batches}"
            )
        rows = _step_train_rows(batches, step)
        if rows.num_rows == 0:
            raise StepNotPinnedError(f"step {step} is not pinned in {self.paths.batches}")
        return rows.sort_by("position").select(list(EXPERIENCE_NAMES))


def rows_of_pin(location: str | Path, step: int, version: int) -> pa.Table | None:
    """The train rows of `step` (experience schema, pinned order) read from the files that
    commit `version` of the `batches` table at `location` added, or None when that commit is
    not the pin of `step`, is gone, or holds files whose rows the file alone does not give.

    A pin is an append of one commit, and the files it adds are never rewritten in place
    (compaction writes new ones), so they hold exactly the step's rows.
    """
    commit = read_commit(location, version)
    if commit is None or commit.info.get(PIN_STEP_KEY) != str(step) or not commit.added:
        return None
    if any(add.get("deletionVector") for add in commit.added):
        return None
    base = local_path(location)
    needed = [*EXPERIENCE_NAMES, "step", "kind", "position"]
    parts = []
    for path in commit.added_paths:
        try:
            data = pq.ParquetFile(base / path)
        except FileNotFoundError:
            return None  # compacted away and vacuumed since
        if not set(needed) <= set(data.schema_arrow.names):
            return None  # physical names differ from the logical ones (column mapping)
        parts.append(data.read(columns=needed))
    rows = pa.concat_tables(parts)
    rows = rows.filter(pc.and_(pc.equal(rows["step"], step), pc.equal(rows["kind"], "train")))
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
