"""The quarantine table: rejected or dropped experiences, each with the reason naming its field."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, write_deltalake

from trinity_dagster.buffer.schema import QUARANTINE_SCHEMA
from trinity_dagster.buffer.tables import open_or_create, retry_commits, writer_properties


@dataclass(frozen=True)
class QuarantineRecord:
    """One quarantined row: eid if known, the bad field, the reason, the row as JSON text."""

    eid: str | None
    field: str
    reason: str
    row_json: str


def _storable(text: str) -> str:
    """`text` as valid UTF-8: characters it cannot encode (lone surrogates) as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def append_quarantine(
    location: str | Path,
    records: Sequence[QuarantineRecord],
    source: str,
    step: int | None = None,
    max_retries: int = 20,
) -> int:
    """Append `records` to the quarantine table at `location` in one commit; the count written."""
    if not records:
        return 0
    now = dt.datetime.now(dt.UTC)
    table = pa.Table.from_pylist(
        [
            {
                "eid": None if r.eid is None else _storable(r.eid),
                "field": _storable(r.field),
                "reason": _storable(r.reason),
                "row_json": _storable(r.row_json),
                "source": source,
                "step": step,
                "quarantined_at": now,
            }
            for r in records
        ],
        schema=QUARANTINE_SCHEMA,
    )
    open_or_create(location, QUARANTINE_SCHEMA)

    def attempt() -> None:
        write_deltalake(
            str(location),
            table,
            mode="append",
            writer_properties=writer_properties(),
            commit_properties=CommitProperties(max_commit_retries=max_retries),
        )

    retry_commits(attempt, max_retries, f"quarantine append to {location}")
    return len(records)
