"""Cheap counts of the buffer for the Dagster `experiences` asset and the data sensor."""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from trinity_dagster.buffer.sampler import state_in
from trinity_dagster.buffer.tables import DataFiles, add_actions, open_table
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths


def _row_count(table: DeltaTable | None) -> int:
    if table is None:
        return 0
    return int(pc.sum(add_actions(table).column("num_records")).as_py() or 0)


def last_pinned_step(config: TrinityConfig) -> int:
    """The highest pinned step (0 if none), from file statistics only."""
    return _last_pinned_step(open_table(RunPaths.of_config(config).batches))


def _last_pinned_step(batches: DeltaTable | None) -> int:
    if batches is None:
        return 0
    actions = add_actions(batches)
    if actions.num_rows == 0:
        return 0
    return int(pc.max(actions.column("max.step")).as_py())


def _rows_at_or_above(table: DeltaTable, seq: int) -> int:
    """Rows with ingest_seq >= seq: file statistics, reading only files that straddle seq."""
    actions = add_actions(table)
    count = 0
    straddling = []
    for path, n, low, high in zip(
        actions.column("path").to_pylist(),
        actions.column("num_records").to_pylist(),
        actions.column("min.ingest_seq").to_pylist(),
        actions.column("max.ingest_seq").to_pylist(),
        strict=True,
    ):
        if low is not None and low >= seq:
            count += n
        elif high is None or high >= seq:
            straddling.append(path)
    files = DataFiles(table)
    for path in straddling:
        fragment = files.open(path)
        seqs = fragment.to_table(columns=["ingest_seq"], filter=ds.field("ingest_seq") >= seq)
        count += seqs.num_rows
    return count


def unconsumed_count(config: TrinityConfig) -> int:
    """Experiences not yet resolved (trained on up to their limit, or dropped)."""
    paths = RunPaths.of_config(config)
    experiences = open_table(paths.experiences)
    batches = open_table(paths.batches)
    return _unconsumed(experiences, batches, _last_pinned_step(batches))


def _unconsumed(experiences: DeltaTable | None, batches: DeltaTable | None, step: int) -> int:
    """`unconsumed_count` from the open tables and the last pinned step."""
    if experiences is None:
        return 0
    state = state_in(batches, step)
    return _rows_at_or_above(experiences, state.watermark) - len(state.done)


def table_stats(config: TrinityConfig) -> dict[str, Any]:
    """Row counts and versions of the buffer tables, plus the unconsumed count."""
    paths = RunPaths.of_config(config)
    experiences = open_table(paths.experiences)
    batches = open_table(paths.batches)
    quarantine = open_table(paths.quarantine)
    step = _last_pinned_step(batches)
    return {
        "row_count": _row_count(experiences),
        "table_version": experiences.version() if experiences is not None else -1,
        "unconsumed": _unconsumed(experiences, batches, step),
        "last_pinned_step": step,
        "quarantined": _row_count(quarantine),
    }
