"""The lineage ledger: two small Delta tables kept up to date from the buffer's own tables.

- `ledger/steps`: one row per experience a step consumed (trained on, or dropped as stale),
  with the batches-table version that pinned it, the experiences-table version the pin read,
  the weights version that produced the experience and the sampler's cursor after the step.
- `ledger/rollouts`: one row per experiences commit, explorer and producing weights version:
  which explore step (when the explorer named it) wrote how many rows with which weights.

Both are derived: `update_ledger` appends what `batches` and `experiences` gained since the
last update (it reads only their new files and commits), so the ledger can always be rebuilt;
the training loop updates it only as it saves a checkpoint (`checkpoint_summary`). Each
update is one commit per table, made against the snapshot it was computed on; of two
concurrent updates one wins and the other re-reads.
The steps table is compacted once it has more than `COMPACT_AT_FILES` files, so a query reads
a few files at any run length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from trinity_dagster.buffer.schema import PIN_STEP_KEY, SEQ_SHIFT, seq_floor
from trinity_dagster.buffer.tables import (
    add_actions,
    open_or_create,
    open_table,
    retry_commits,
    table_dataset,
    writer_properties,
)
from trinity_dagster.buffer.writer import EXPLORE_STEP_KEY
from trinity_dagster.paths import RunPaths

STEPS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),  # 'train' or 'stale' (dropped)
        pa.field("eid", pa.string(), nullable=False),
        pa.field("model_version", pa.int64(), nullable=False),  # weights that produced it
        pa.field("ingest_seq", pa.int64(), nullable=False),
        pa.field("source_version", pa.int64(), nullable=False),  # experiences version read
        pa.field("batch_version", pa.int64(), nullable=True),  # batches version of the pin
        pa.field("watermark", pa.int64(), nullable=False),  # sampler cursor after the step
    ]
)
ROLLOUTS_SCHEMA = pa.schema(
    [
        pa.field("experiences_version", pa.int64(), nullable=False),
        pa.field("explorer_id", pa.string(), nullable=False),
        pa.field("explore_step", pa.int64(), nullable=True),  # None: the writer named none
        pa.field("model_version", pa.int64(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
    ]
)
COMPACT_AT_FILES = 32
MAX_RETRIES = 20


@dataclass(frozen=True)
class LedgerUpdate:
    """What one `update_ledger` added: step rows (and the steps they cover), rollout rows."""

    step_rows: int
    steps: tuple[int, int] | None  # first and last step added
    rollout_rows: int


def _stat_max(table: DeltaTable, column: str) -> int | None:
    """The largest value of `column` in `table`'s file statistics (None: no rows)."""
    actions = add_actions(table)
    name = f"max.{column}"
    if actions.num_rows == 0 or name not in actions.column_names:
        return None
    value = pc.max(actions.column(name)).as_py()
    return None if value is None else int(value)


def _commit_metadata(table: DeltaTable, after: int, key: str) -> dict[int, str]:
    """`key` of the commit metadata of `table`'s commits after version `after`, by version."""
    newer = table.version() - after
    if newer <= 0:
        return {}
    return {
        int(commit["version"]): commit[key]
        for commit in table.history(limit=newer)
        if key in commit and "version" in commit
    }


def _append(table: DeltaTable, data: pa.Table) -> None:
    write_deltalake(
        table,
        data,
        mode="append",
        writer_properties=writer_properties(),
        commit_properties=CommitProperties(max_commit_retries=0),
    )


def _new_step_rows(paths: RunPaths, ledger: DeltaTable) -> pa.Table | None:
    """The rows of the steps pinned in `batches` after the last step in `ledger`."""
    batches = open_table(paths.batches)
    if batches is None:
        return None
    last_step = _stat_max(ledger, "step") or 0
    last_pin = _stat_max(ledger, "batch_version")
    rows = table_dataset(batches, "step", low=last_step + 1).to_table(
        columns=[
            "step",
            "position",
            "kind",
            "eid",
            "model_version",
            "ingest_seq",
            "source_version",
        ],
        filter=pc.field("step") > last_step,
    )
    if rows.num_rows == 0:
        return None
    rows = rows.sort_by([("step", "ascending"), ("position", "ascending")])
    steps = rows.column("step")
    pinned_by = {
        int(step): version
        for version, step in _commit_metadata(
            batches, -1 if last_pin is None else last_pin, PIN_STEP_KEY
        ).items()
    }
    step_list = steps.to_pylist()
    watermarks = _watermarks(batches, sorted(set(step_list)))
    batch_version = pa.array([pinned_by.get(s) for s in step_list], pa.int64())
    watermark = pa.array([watermarks[s] for s in step_list], pa.int64())
    return pa.Table.from_arrays(
        [rows.column(name) for name in STEPS_SCHEMA.names[:7]] + [batch_version, watermark],
        schema=STEPS_SCHEMA,
    )


def _watermarks(batches: DeltaTable, steps: list[int]) -> dict[int, int]:
    """The sampler cursor recorded with each of `steps` (first row of each step)."""
    low, high = steps[0], steps[-1]
    states = table_dataset(batches, "step", low, high).to_table(
        columns=["step", "sampler_state"],
        filter=(pc.field("step") >= low) & (pc.field("step") <= high) & (pc.field("position") == 0),
    )
    return {
        int(step): int(json.loads(state)["watermark"])
        for step, state in zip(
            states.column("step").to_pylist(),
            states.column("sampler_state").to_pylist(),
            strict=True,
        )
    }


def _new_rollout_rows(paths: RunPaths, ledger: DeltaTable) -> pa.Table | None:
    """The rows of the experiences commits after the last one in `ledger`."""
    experiences = open_table(paths.experiences)
    if experiences is None:
        return None
    last = _stat_max(ledger, "experiences_version")
    floor = seq_floor(0 if last is None else last + 1)
    rows = table_dataset(experiences, "ingest_seq", low=floor).to_table(
        columns=["ingest_seq", "explorer_id", "model_version"],
        filter=pc.field("ingest_seq") >= floor,
    )
    if rows.num_rows == 0:
        return None
    commit = pc.shift_right(rows.column("ingest_seq"), SEQ_SHIFT)
    grouped = (
        pa.table(
            {
                "experiences_version": commit,
                "explorer_id": rows.column("explorer_id"),
                "model_version": rows.column("model_version"),
            }
        )
        .group_by(["experiences_version", "explorer_id", "model_version"])
        .aggregate([("model_version", "count")])
        .sort_by([("experiences_version", "ascending"), ("model_version", "ascending")])
    )
    named = _commit_metadata(experiences, -1 if last is None else last, EXPLORE_STEP_KEY)
    versions = grouped.column("experiences_version").to_pylist()
    explore_step = pa.array([int(named[v]) if v in named else None for v in versions], pa.int64())
    return pa.Table.from_arrays(
        [
            grouped.column("experiences_version"),
            grouped.column("explorer_id"),
            explore_step,
            grouped.column("model_version"),
            grouped.column("model_version_count"),
        ],
        schema=ROLLOUTS_SCHEMA,
    )


def update_ledger(paths: RunPaths) -> LedgerUpdate:
    """Append to the ledger what `batches` and `experiences` gained since its last update."""

    def steps_attempt() -> pa.Table | None:
        ledger = open_or_create(paths.ledger_steps, STEPS_SCHEMA)
        new = _new_step_rows(paths, ledger)
        if new is not None:
            _append(ledger, new)  # against the snapshot `new` was computed on
        return new

    def rollouts_attempt() -> pa.Table | None:
        ledger = open_or_create(paths.ledger_rollouts, ROLLOUTS_SCHEMA)
        new = _new_rollout_rows(paths, ledger)
        if new is not None:
            _append(ledger, new)
        return new

    steps = retry_commits(steps_attempt, MAX_RETRIES, "lineage ledger update (steps)")
    rollouts = retry_commits(rollouts_attempt, MAX_RETRIES, "lineage ledger update (rollouts)")
    for location in (paths.ledger_steps, paths.ledger_rollouts):
        compact_if_fragmented(location)
    span = None
    if steps is not None:
        step_column = steps.column("step")
        span = (pc.min(step_column).as_py(), pc.max(step_column).as_py())
    return LedgerUpdate(
        step_rows=0 if steps is None else steps.num_rows,
        steps=span,
        rollout_rows=0 if rollouts is None else rollouts.num_rows,
    )


def compact_if_fragmented(location: str) -> None:
    """Bin-pack the ledger table at `location` once it has more than `COMPACT_AT_FILES` files."""
    table = open_table(location)
    if table is not None and add_actions(table).num_rows > COMPACT_AT_FILES:
        table.optimize.compact(writer_properties=writer_properties())
