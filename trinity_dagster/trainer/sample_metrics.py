"""Trinity-RFT's `sample/*` metrics of a pinned batch: how many tasks it holds and which
weights versions produced its rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from trinity_dagster.buffer.sampler import PinResult, pinned_columns
from trinity_dagster.paths import RunPaths

COLUMNS = ["task_id", "model_version"]


def sample_metrics(paths: RunPaths, batch: PinResult) -> dict[str, float]:
    """`sample/task_count` (distinct tasks) and `sample/model_version/{mean,max,min}` of the
    rows pinned to `batch.step` (read back when the batch was pinned by an earlier run)."""
    rows = (
        batch.rows.select(COLUMNS)
        if batch.rows is not None
        else pinned_columns(paths, batch.step, COLUMNS)
    )
    return batch_metrics(rows)


def batch_metrics(rows: pa.Table) -> dict[str, float]:
    """The `sample/*` metrics of rows with `task_id` and `model_version` (none when empty)."""
    if rows.num_rows == 0:
        return {}
    versions = rows.column("model_version")
    return {
        "sample/task_count": float(pc.count_distinct(rows.column("task_id")).as_py()),
        "sample/model_version/mean": float(pc.mean(versions).as_py()),
        "sample/model_version/max": float(pc.max(versions).as_py()),
        "sample/model_version/min": float(pc.min(versions).as_py()),
    }
