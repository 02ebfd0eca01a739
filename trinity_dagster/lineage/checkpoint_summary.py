"""What trained checkpoint N, summed up once: `logs/checkpoint_lineage/step_N.json`.

The trainer writes the summary just before it saves step N, bringing the ledger up to date
on the way; whatever records `checkpoint[N]` in Dagster (the sensor in the code server, or
the run that asked for the save) then reads a small file instead of the Delta tables. So the
code server, which runs the sensor for the whole training, does not grow by what the scans of
those tables keep (60-80 MB for a hundred steps' batches).
A missing or unreadable summary (a checkpoint saved by an older version, a file torn by a
crash) is computed where it is asked for. Reading one needs no data library: the ledger's
modules (pyarrow, deltalake) are imported when a summary is computed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key


def summary_path(paths: RunPaths, step: int) -> Path:
    """The lineage summary of checkpoint `step`."""
    return paths.checkpoint_lineage / f"step_{step_key(step)}.json"


def read_summary(paths: RunPaths, step: int) -> dict[str, Any] | None:
    """The stored summary of checkpoint `step`, or None if there is none (or it is torn)."""
    try:
        found = json.loads(summary_path(paths, step).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    found["by_weights_version"] = {int(v): n for v, n in found["by_weights_version"].items()}
    return found


def write_summary(paths: RunPaths, step: int) -> dict[str, Any]:
    """Bring the ledger up to date, sum up steps 1..`step` and store the summary.

    Raises `LineageQueryError` if step `step` has not been trained.
    """
    from trinity_dagster.lineage.ledger import update_ledger
    from trinity_dagster.lineage.queries import LedgerView, checkpoint_totals

    update_ledger(paths)
    answer = checkpoint_totals(LedgerView.open(paths), step)
    summary = {
        "step": step,
        "by_weights_version": answer["by_weights_version"],
        "gaps": sorted(set(answer["missing_steps"] + answer["steps_without_record"])),
        "experiences_trained": answer["experiences_trained"],
        "staleness_max": answer["staleness_max"],
    }
    # not flushed: a summary lost with the page cache is computed again when asked for
    write_text_atomic(summary_path(paths, step), json.dumps(summary), fsync=False)
    return summary
