"""`trained_exactly_once`: a proof from the data on disk that no experience was trained twice
or skipped, across kills and resumes.

It holds when
- the pinned steps are 1..P without a gap, and every step up to the newest trained one has
  the engine's record (it was trained);
- no experience is consumed more often than its sampler allows (once, or `buffer.reuse_limit`
  times as a training row and at most once dropped as stale), and the one consumed is the one
  written (same `ingest_seq`);
- every experience below the sampler's cursor after step P was consumed: written rows are
  either consumed or still waiting above the cursor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trinity_dagster.buffer.tables import open_table, table_dataset
from trinity_dagster.lineage.ledger import update_ledger
from trinity_dagster.lineage.queries import LedgerView
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import recorded_steps

EXAMPLES = 5  # offending eids or steps named per problem


@dataclass(frozen=True)
class Verdict:
    """Whether every experience was consumed as the sampler promises, with the counts."""

    problems: list[str]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """Plain values for JSON and Dagster metadata."""
        return {"passed": self.passed, "problems": self.problems, **self.counts}


def _listed(values: list[Any]) -> str:
    shown = ", ".join(str(v) for v in values[:EXAMPLES])
    return shown + (f" and {len(values) - EXAMPLES} more" if len(values) > EXAMPLES else "")


def verify_trained_once(paths: RunPaths, reuse_limit: int = 1) -> Verdict:
    """Bring the ledger up to date and check it against the experiences and engine records."""
    update_ledger(paths)
    view = LedgerView.open(paths)
    consumed = view.step_rows(["step", "kind", "eid", "ingest_seq", "watermark"])
    experiences = open_table(paths.experiences)
    written = (
        table_dataset(experiences).to_table(columns=["eid", "ingest_seq"])
        if experiences is not None
        else pa.table({"eid": pa.array([], pa.string()), "ingest_seq": pa.array([], pa.int64())})
    )
    problems: list[str] = []
    steps = sorted(set(consumed.column("step").to_pylist()))
    last_pinned = steps[-1] if steps else 0
    trained = recorded_steps(paths)
    last_trained = max(trained, default=0)
    if gaps := sorted(set(range(1, last_pinned + 1)) - set(steps)):
        problems.append(f"steps not pinned below step {last_pinned}: {_listed(gaps)}")
    if untrained := [s for s in range(1, last_trained + 1) if s not in trained]:
        problems.append(f"steps without the engine's record: {_listed(untrained)}")
    problems += _overused(consumed, reuse_limit)
    problems += _mismatched(consumed, written)
    cursor = 0
    if steps:
        last = consumed.filter(pc.equal(consumed.column("step"), last_pinned))
        cursor = pc.max(last.column("watermark")).as_py()
    below = written.filter(pc.less(written.column("ingest_seq"), cursor))
    skipped = below.filter(pc.invert(pc.is_in(below.column("eid"), consumed.column("eid"))))
    if skipped.num_rows:
        problems.append(
            f"{skipped.num_rows} experiences below the sampler's cursor ({cursor}) were never "
            f"consumed: {_listed(skipped.column('eid').to_pylist())}"
        )
    train = consumed.filter(pc.equal(consumed.column("kind"), "train"))
    done = train.filter(pc.less_equal(train.column("step"), last_trained))
    consumed_eids = pc.unique(consumed.column("eid"))
    return Verdict(
        problems,
        {
            "experiences_written": written.num_rows,
            "experiences_trained": len(pc.unique(done.column("eid"))),
            "experiences_pinned_not_trained": len(
                pc.unique(
                    train.filter(pc.greater(train.column("step"), last_trained)).column("eid")
                )
            ),
            "experiences_dropped": consumed.num_rows - train.num_rows,
            "experiences_unconsumed": written.num_rows
            - pc.sum(pc.is_in(written.column("eid"), consumed_eids)).as_py(),
            "steps_pinned": last_pinned,
            "steps_trained": last_trained,
            "cursor": cursor,
        },
    )


def _overused(consumed: pa.Table, reuse_limit: int) -> list[str]:
    """Experiences trained more often than `reuse_limit`, or dropped more than once."""
    problems = []
    for kind, limit in (("train", reuse_limit), ("stale", 1)):
        rows = consumed.filter(pc.equal(consumed.column("kind"), kind))
        counts = rows.group_by("eid").aggregate([("eid", "count")])
        over = counts.filter(pc.greater(counts.column("eid_count"), limit))
        if over.num_rows:
            verb = "trained" if kind == "train" else "dropped"
            problems.append(
                f"{over.num_rows} experiences {verb} more than {limit} time(s): "
                f"{_listed(over.column('eid').to_pylist())}"
            )
    if reuse_limit == 1:
        counts = consumed.group_by("eid").aggregate([("eid", "count")])
        twice = counts.filter(pc.greater(counts.column("eid_count"), 1))
        if twice.num_rows:
            problems.append(
                f"{twice.num_rows} experiences consumed by more than one step: "
                f"{_listed(twice.column('eid').to_pylist())}"
            )
    return problems


def _mismatched(consumed: pa.Table, written: pa.Table) -> list[str]:
    """Consumed experiences that are not in the experiences table as they were pinned."""
    pinned = consumed.select(["eid", "ingest_seq"]).group_by(["eid", "ingest_seq"]).aggregate([])
    joined = pinned.join(written, "eid", join_type="left outer", right_suffix="_written")
    missing = joined.filter(pc.is_null(joined.column("ingest_seq_written")))
    other = joined.filter(
        pc.not_equal(joined.column("ingest_seq"), joined.column("ingest_seq_written"))
    )
    problems = []
    if missing.num_rows:
        problems.append(
            f"{missing.num_rows} consumed experiences are not in the experiences table: "
            f"{_listed(missing.column('eid').to_pylist())}"
        )
    if other.num_rows:
        problems.append(
            f"{other.num_rows} consumed experiences differ from the written ones (ingest_seq): "
            f"{_listed(other.column('eid').to_pylist())}"
        )
    return problems
