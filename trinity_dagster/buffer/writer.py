"""The validated experience writer: one atomic Delta commit per write, bad rows quarantined.

`ingest_seq` is derived from the table version the commit lands at:
`ingest_seq = (version << 32) + row index`. Every commit is attempted with delta-rs'
own retries disabled, against the snapshot the rows were validated and numbered on; if
another process committed first, Delta raises `CommitFailedError` and the write is
re-validated (eid uniqueness) and renumbered against the new snapshot, with backoff. A
version is committed by exactly one writer, so sequence numbers are unique across processes
and strictly increasing in commit order, and eid uniqueness is checked against exactly the
rows committed before.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, write_deltalake

from trinity_dagster.buffer.eid_index import EidIndex
from trinity_dagster.buffer.quarantine import QuarantineRecord, append_quarantine
from trinity_dagster.buffer.schema import EXPERIENCE_SCHEMA, seq_floor
from trinity_dagster.buffer.tables import (
    DataFiles,
    HeldTable,
    add_actions,
    read_commit,
    retry_commits,
    table_dataset,
    writer_properties,
)
from trinity_dagster.buffer.validation import (
    Rejection,
    conform_table,
    row_to_json,
    rows_to_table,
    semantic_checks,
)
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff.wakeup import TRAINER, wake
from trinity_dagster.paths import RunPaths

# Commit metadata naming the explore step a commit's rows came from (lineage ledger).
EXPLORE_STEP_KEY = "trinity.explore_step"


@dataclass(frozen=True)
class WriteReport:
    """What one write did: rows committed, rows quarantined with reasons, the commit version."""

    written: int
    quarantined: int
    version: int | None
    reasons: list[Rejection] = field(default_factory=list)

    def as_metadata(self) -> dict[str, Any]:
        """Plain counts for run metadata."""
        return {"written": self.written, "quarantined": self.quarantined, "version": self.version}


def _check_rows_container(rows: object) -> None:
    """Reject a lone row or a string, which would otherwise be iterated as rows."""
    if isinstance(rows, Mapping | str | bytes):
        raise TypeError(
            f"ExperienceWriter.write: expected a sequence of row mappings or a pyarrow.Table, "
            f"got a single {type(rows).__name__} (to write one row, pass [row])"
        )


class ExperienceWriter:
    """Appends validated experiences to the run's experiences table; safe across processes."""

    def __init__(
        self, config: TrinityConfig, known_versions: Callable[[], set[int]] | None = None
    ) -> None:
        self._paths = RunPaths.of_config(config)
        self._max_len = config.model.max_model_len
        self._max_retries = config.buffer.writer_max_retries
        self._known_versions = known_versions
        self._eids = EidIndex()
        self._seen_files: set[str] = set()
        self._seen_version = -1  # the table version whose data files' eids are all indexed
        self._delta = HeldTable(self._paths.experiences, create_with=EXPERIENCE_SCHEMA)

    def write(
        self, rows: Sequence[Mapping[str, Any]] | pa.Table, explore_step: int | None = None
    ) -> WriteReport:
        """Validate `rows`, append the valid ones in one commit, quarantine the rest.

        `explore_step` (an explorer's step number) is kept in the commit's metadata, so the
        lineage ledger can tell which rollouts the rows came from.

        Raises TypeError when `rows` is a single row (a mapping) or text instead of a sequence
        of rows or a table.
        """
        _check_rows_container(rows)
        now = dt.datetime.now(dt.UTC)
        if isinstance(rows, pa.Table):
            table, kept, unstorable = conform_table(rows, now)
        else:
            table, kept, unstorable = rows_to_table(rows, now)
        known = self._known_versions() if self._known_versions is not None else None
        info = {} if explore_step is None else {EXPLORE_STEP_KEY: str(explore_step)}
        outcome: dict[str, Any] = {}

        def attempt() -> None:
            delta = self._delta.get()
            assert delta is not None  # created if absent
            self._refresh_eids(delta)
            stored = _stored_among(delta, self._eids.candidates(_text_eids(table)))
            problems = semantic_checks(table, self._max_len, known, stored)
            good = np.array([p is None for p in problems], dtype=bool)
            valid = table.filter(pa.array(good)) if table.num_rows else table
            version = delta.version() + 1
            if valid.num_rows:
                seqs = pa.array(seq_floor(version) + np.arange(valid.num_rows), pa.int64())
                data = valid.append_column(EXPERIENCE_SCHEMA.field("ingest_seq"), seqs)
                write_deltalake(
                    delta,
                    data,
                    mode="append",
                    writer_properties=writer_properties(),
                    commit_properties=CommitProperties(max_commit_retries=0, custom_metadata=info),
                )
                self._eids.add(valid.column("eid").to_pylist())
                if delta.version() == version:  # our commit is the newest: its files are ours
                    self._seen_own_commit(version)
            outcome.update(problems=problems, written=valid.num_rows, version=version)

        retry_commits(attempt, self._max_retries, f"experience write to {self._paths.experiences}")
        if outcome["written"]:
            wake(self._paths.wakeup, TRAINER)  # a trainer loop waiting for rows looks now
        rejects = unstorable + self._semantic_rejects(table, kept, outcome["problems"])
        rejects.sort(key=lambda r: r.index)
        append_quarantine(
            self._paths.quarantine,
            [QuarantineRecord(r.eid, r.field, r.reason, r.row_json) for r in rejects],
            source="writer",
            max_retries=self._max_retries,
        )
        return WriteReport(
            written=outcome["written"],
            quarantined=len(rejects),
            version=outcome["version"] if outcome["written"] else None,
            reasons=rejects,
        )

    @staticmethod
    def _semantic_rejects(
        table: pa.Table, kept: list[int], problems: list[tuple[str, str] | None]
    ) -> list[Rejection]:
        flagged = [(i, p) for i, p in enumerate(problems) if p is not None]
        if not flagged:
            return []
        rows = table.take(pa.array([i for i, _ in flagged], pa.int64())).to_pylist()
        out = []
        for (i, (bad_field, reason)), row in zip(flagged, rows, strict=True):
            eid = row["eid"] if isinstance(row.get("eid"), str) else None
            out.append(Rejection(kept[i], eid, bad_field, reason, row_to_json(row)))
        return out

    def _refresh_eids(self, delta: DeltaTable) -> None:
        """Add the eids of data files not read before (compaction rewrites are harmless)."""
        if delta.version() == self._seen_version:
            return
        paths = add_actions(delta).column("path").to_pylist()
        files = DataFiles(delta)
        for path in paths:
            if path not in self._seen_files:
                eids = files.open(path).to_table(columns=["eid"]).column("eid")
                self._eids.add(eids.to_pylist())
                self._seen_files.add(path)
        self._seen_version = delta.version()

    def _seen_own_commit(self, version: int) -> None:
        """Note the files of this writer's commit `version` (their eids are indexed already),
        read from the commit itself rather than from the whole table's file list."""
        commit = read_commit(self._paths.experiences, version)
        if commit is None or self._seen_version != version - 1:
            return  # the next refresh reads the table's file list
        self._seen_files.update(commit.added_paths)
        self._seen_version = version


def _text_eids(table: pa.Table) -> list[str]:
    """The eids of `table` that are text (a null eid is refused by the checks anyway)."""
    return [eid for eid in table.column("eid").to_pylist() if isinstance(eid, str)]


def _stored_among(delta: DeltaTable, eids: list[str]) -> set[str]:
    """Those of `eids` that the table's snapshot `delta` holds (one scan of its eid column,
    only when the index names candidates: a retried write, or a hash collision)."""
    if not eids:
        return set()
    found = table_dataset(delta).to_table(columns=["eid"], filter=ds.field("eid").isin(eids))
    return set(found.column("eid").to_pylist())
