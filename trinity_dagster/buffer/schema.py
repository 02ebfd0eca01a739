"""Arrow schemas of the buffer's Delta tables: experiences, batches and quarantine."""

from __future__ import annotations

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")

# Each experience column with its arrow type, nullability and meaning (docs/architecture.md).
EXPERIENCE_COLUMNS: tuple[tuple[str, pa.DataType, bool, str], ...] = (
    ("eid", pa.string(), False, "experience id, unique in the table"),
    ("task_id", pa.string(), False, "the task (prompt) it answers"),
    ("group_id", pa.string(), False, "GRPO group: same prompt, repeat_times responses"),
    ("explorer_id", pa.string(), False, "which explorer wrote it"),
    ("tokens", pa.list_(pa.int32()), False, "prompt + response token ids"),
    ("prompt_length", pa.int32(), False, "number of prompt tokens at the start of tokens"),
    ("action_mask", pa.list_(pa.bool_()), False, "one per response token: counts in the loss"),
    ("logprobs", pa.list_(pa.float32()), False, "one per response token, rollout policy"),
    ("reward", pa.float64(), False, "finite scalar reward"),
    ("advantages", pa.list_(pa.float32()), True, "one per response token, if precomputed"),
    ("returns", pa.list_(pa.float32()), True, "one per response token, if precomputed"),
    ("model_version", pa.int64(), False, "weights version that produced it (0 = initial)"),
    ("created_at", TIMESTAMP, False, "when the experience was made"),
    ("info", pa.string(), False, "JSON text"),
    ("ingest_seq", pa.int64(), False, "writer-assigned, strictly increasing in commit order"),
)

EXPERIENCE_SCHEMA = pa.schema(
    [pa.field(name, dtype, nullable=nullable) for name, dtype, nullable, _ in EXPERIENCE_COLUMNS]
)
COLUMN_DOCS: dict[str, str] = {name: doc for name, _, _, doc in EXPERIENCE_COLUMNS}
EXPERIENCE_NAMES: tuple[str, ...] = tuple(EXPERIENCE_SCHEMA.names)

# The rows of each step are copies of experience rows, plus where and how they were pinned.
BATCH_EXTRA_COLUMNS: tuple[tuple[str, pa.DataType, bool, str], ...] = (
    ("step", pa.int64(), False, "training step the row is pinned to"),
    ("position", pa.int32(), False, "order of the row within the step's batch"),
    ("kind", pa.string(), False, "'train': trains the step; 'stale': dropped by the strategy"),
    ("source_version", pa.int64(), False, "experiences table version the pin read"),
    ("strategy", pa.string(), False, "sample strategy that chose the row"),
    ("sampler_state", pa.string(), False, "JSON SamplerState after this step was pinned"),
    ("pinned_at", TIMESTAMP, False, "when the step was pinned"),
)
BATCH_SCHEMA = pa.schema(
    list(EXPERIENCE_SCHEMA)
    + [pa.field(name, dtype, nullable=nullable) for name, dtype, nullable, _ in BATCH_EXTRA_COLUMNS]
)
# Commit metadata naming the step a `batches` commit pinned (the lineage ledger and the
# engine's batch reader read it).
PIN_STEP_KEY = "trinity.step"

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("eid", pa.string(), nullable=True),
        pa.field("field", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("row_json", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=True),
        pa.field("quarantined_at", TIMESTAMP, nullable=False),
    ]
)

# Rows per parquet row group: keeps reads of the oldest pending rows small at any table size.
ROW_GROUP_ROWS = 8192

# ingest_seq = (committed experiences table version << SEQ_SHIFT) + row index in the commit.
SEQ_SHIFT = 32


def seq_floor(version: int) -> int:
    """The smallest ingest_seq a commit at table `version` can assign."""
    return version << SEQ_SHIFT
