"""The newest recorded result of the `trained_exactly_once` check, from a Dagster instance.

The `run` command waits for it at the end of training and the sensor asks whether a run
checked it since; both compare the event's own time, since the check's execution record keeps
whole seconds only.
"""

from __future__ import annotations

from typing import Any

from trinity_dagster.graph_names import TRAIN, TRAINED_EXACTLY_ONCE


def latest_lineage_check(instance: Any, since: float) -> tuple[str, Any] | None:
    """(run id, `AssetCheckEvaluation`) of the newest `trained_exactly_once` result logged at
    or after `since` (seconds since the epoch); None if there is none (a check only planned
    by a run counts as none)."""
    import dagster as dg

    key = dg.AssetCheckKey(dg.AssetKey(TRAIN), TRAINED_EXACTLY_ONCE)
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key([key]).get(key)
    if record is None or record.event is None or record.event.timestamp < since:
        return None
    evaluation = record.event.dagster_event.event_specific_data
    if not isinstance(evaluation, dg.AssetCheckEvaluation):
        return None  # planned, not evaluated yet
    return record.run_id, evaluation
