"""The three lineage questions, answered from the ledger and the run root as plain dicts.

- `checkpoint_lineage(N)`: the steps 1..N that led to checkpoint N, each with its batch and
  the weights versions that produced its experiences, back to the initial model (version 0);
- `eid_lineage(X...)`: which step consumed each experience, which weights and rollout
  produced it, and the first kept checkpoint and published weights that contain its effect;
- `weights_lineage(V)`: which rollouts used weights V and which steps trained on them.

Staleness of a trained experience is `(step - 1) - model_version`: how many versions older
than the weights it trained are the weights that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from trinity_dagster.buffer.schema import SEQ_SHIFT
from trinity_dagster.buffer.tables import open_table, table_dataset
from trinity_dagster.checkpoint.layout import (
    MANIFEST_FILE,
    checkpoint_dir,
    published_weights_dir,
    scan_step_dirs,
    weights_versions_on_disk,
)
from trinity_dagster.lineage.ledger import ROLLOUTS_SCHEMA, STEPS_SCHEMA
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import recorded_steps


class LineageQueryError(LookupError):
    """The ledger cannot answer: an unknown eid, a step not trained yet; the message says."""


@dataclass(frozen=True)
class LedgerView:
    """The ledger's two tables as pyarrow datasets (empty when a table does not exist)."""

    paths: RunPaths
    steps: ds.Dataset
    rollouts: ds.Dataset

    @classmethod
    def open(cls, paths: RunPaths) -> LedgerView:
        """The ledger of the run at `paths`, as it is now (see `update_ledger`)."""
        return cls(
            paths,
            _dataset(paths.ledger_steps, STEPS_SCHEMA),
            _dataset(paths.ledger_rollouts, ROLLOUTS_SCHEMA),
        )

    def step_rows(self, columns: list[str], where: ds.Expression | None = None) -> pa.Table:
        """Columns of the rows of the steps table that match `where`."""
        return self.steps.to_table(columns=columns, filter=where)


def _dataset(location: str, schema: pa.Schema) -> ds.Dataset:
    table = open_table(location)
    if table is None:
        return ds.dataset(schema.empty_table())
    return table_dataset(table)


def counts_by(table: pa.Table, key: str) -> dict[int, int]:
    """Rows per value of the integer column `key`, in ascending order of the value."""
    counts = pc.value_counts(table.column(key))  # one kernel; a group-by runs Acero's threads
    return dict(
        sorted(
            zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True)
        )
    )


def _kept_checkpoints(paths: RunPaths) -> list[int]:
    """Steps of the complete checkpoints on disk (manifest present), ascending."""
    return [
        entry.step
        for entry in scan_step_dirs(paths.checkpoints)
        if entry.kind == "final" and (entry.path / MANIFEST_FILE).is_file()
    ]


def _first_at_or_after(values: list[int], step: int) -> int | None:
    return next((v for v in sorted(values) if v >= step), None)


def checkpoint_lineage(view: LedgerView, step: int) -> dict[str, Any]:
    """Steps 1..`step` behind checkpoint `step`: batches, producing weights, gaps."""
    totals, rows, train = _totals(view, step)
    return {**totals, "chain": _chain(rows, train)}


def checkpoint_totals(view: LedgerView, step: int) -> dict[str, Any]:
    """`checkpoint_lineage` without its per-step chain: the counts, gaps and staleness."""
    return _totals(view, step)[0]


def _totals(view: LedgerView, step: int) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    """`checkpoint_totals`, with the ledger rows of steps 1..`step` it read and those of them
    that were trained."""
    if step < 1:
        raise LineageQueryError(f"checkpoint {step}: checkpoints are of steps >= 1")
    trained = recorded_steps(view.paths)
    ckpt = checkpoint_dir(view.paths, step)
    on_disk = (ckpt / MANIFEST_FILE).is_file()
    if step not in trained and not on_disk:
        raise LineageQueryError(
            f"step {step} has not been trained (newest trained step: {max(trained, default=0)})"
        )
    rows = view.step_rows(
        ["step", "kind", "model_version", "batch_version", "source_version"],
        ds.field("step") <= step,
    )
    train = rows.filter(pc.equal(rows.column("kind"), "train"))
    pinned = set(pc.unique(rows.column("step")).to_pylist())
    staleness = pc.subtract(pc.subtract(train.column("step"), 1), train.column("model_version"))
    totals = {
        "checkpoint": step,
        "path": str(ckpt),
        "on_disk": on_disk,
        "initial_model": str(published_weights_dir(view.paths, 0)),
        "steps": len(pinned),
        "missing_steps": [s for s in range(1, step + 1) if s not in pinned],
        "steps_without_record": [s for s in range(1, step + 1) if s not in trained],
        "experiences_trained": train.num_rows,
        "experiences_dropped": rows.num_rows - train.num_rows,
        "by_weights_version": counts_by(train, "model_version"),
        "staleness_min": pc.min(staleness).as_py(),
        "staleness_max": pc.max(staleness).as_py(),
    }
    return totals, rows, train


def _chain(rows: pa.Table, train: pa.Table) -> list[dict[str, Any]]:
    """One entry per step: parent, batch and experiences versions, counts per weights version."""
    per_step = (
        rows.group_by("step")
        .aggregate([("batch_version", "max"), ("source_version", "max"), ("kind", "count")])
        .sort_by("step")
    )
    versions = train.group_by(["step", "model_version"]).aggregate([("model_version", "count")])
    by_step: dict[int, dict[int, int]] = {}
    for s, v, n in zip(
        versions.column("step").to_pylist(),
        versions.column("model_version").to_pylist(),
        versions.column("model_version_count").to_pylist(),
        strict=True,
    ):
        by_step.setdefault(s, {})[v] = n
    chain = []
    for s, batch_version, source_version, total in zip(
        per_step.column("step").to_pylist(),
        per_step.column("batch_version_max").to_pylist(),
        per_step.column("source_version_max").to_pylist(),
        per_step.column("kind_count").to_pylist(),
        strict=True,
    ):
        produced = dict(sorted(by_step.get(s, {}).items()))
        trained = sum(produced.values())
        chain.append(
            {
                "step": s,
                "parent": s - 1,
                "batch_version": batch_version,
                "source_version": source_version,
                "trained": trained,
                "dropped": total - trained,
                "by_weights_version": produced,
            }
        )
    return chain


def eid_lineage(view: LedgerView, eids: list[str]) -> list[dict[str, Any]]:
    """Where each experience of `eids` went: consumed by which step (or waiting above the
    sampler's cursor), produced by which weights in which rollout, and the first kept
    checkpoint and weights on disk that contain its effect. Raises LineageQueryError naming
    the eids found nowhere."""
    wanted = pa.array(eids, pa.string())
    rows = view.step_rows(
        ["eid", "step", "kind", "model_version", "ingest_seq"], ds.field("eid").isin(wanted)
    ).sort_by("step")
    uses: dict[str, list[dict[str, Any]]] = {}
    produced: dict[str, tuple[int, int]] = {}
    for row in rows.to_pylist():
        uses.setdefault(row["eid"], []).append({"step": row["step"], "kind": row["kind"]})
        produced[row["eid"]] = (row["ingest_seq"], row["model_version"])
    waiting = [eid for eid in eids if eid not in produced]
    if waiting:
        produced.update(_written(view.paths, waiting))
    if unknown := [eid for eid in eids if eid not in produced]:
        raise LineageQueryError(
            f"no experience {', '.join(map(repr, unknown[:5]))}"
            f"{' and more' if len(unknown) > 5 else ''} in {view.paths.experiences}"
        )
    rollouts = _rollouts_by_commit(view)
    checkpoints = _kept_checkpoints(view.paths)
    weights = weights_versions_on_disk(view.paths)
    cursor = pc.max(view.step_rows(["watermark"]).column("watermark")).as_py()
    answers = []
    for eid in eids:
        ingest_seq, model_version = produced[eid]
        trained = [u["step"] for u in uses.get(eid, []) if u["kind"] == "train"]
        status = "trained" if trained else "dropped" if eid in uses else "unconsumed"
        effect = min(trained) if trained else None
        commit = ingest_seq >> SEQ_SHIFT
        answers.append(
            {
                "eid": eid,
                "status": status,
                "uses": uses.get(eid, []),
                "model_version": model_version,
                "ingest_seq": ingest_seq,
                "cursor": cursor,
                "rollout": rollouts.get((commit, model_version)),
                "first_checkpoint": None
                if effect is None
                else _first_at_or_after(checkpoints, effect),
                "first_published_weights": (
                    None if effect is None else _first_at_or_after(weights, effect)
                ),
            }
        )
    return answers


def _written(paths: RunPaths, eids: list[str]) -> dict[str, tuple[int, int]]:
    """(ingest_seq, model_version) of those of `eids` in the experiences table."""
    experiences = open_table(paths.experiences)
    if experiences is None:
        return {}
    found = table_dataset(experiences).to_table(
        columns=["eid", "ingest_seq", "model_version"],
        filter=ds.field("eid").isin(pa.array(eids, pa.string())),
    )
    return {r["eid"]: (r["ingest_seq"], r["model_version"]) for r in found.to_pylist()}


def _rollouts_by_commit(view: LedgerView) -> dict[tuple[int, int], dict[str, Any]]:
    """Each explorer commit (by experiences version and producing weights version)."""
    table = view.rollouts.to_table(
        columns=["experiences_version", "explorer_id", "explore_step", "model_version"]
    )
    return {
        (r["experiences_version"], r["model_version"]): {
            "experiences_version": r["experiences_version"],
            "explorer_id": r["explorer_id"],
            "explore_step": r["explore_step"],
        }
        for r in table.to_pylist()
    }


def weights_lineage(view: LedgerView, version: int) -> dict[str, Any]:
    """The rollouts that used weights `version` and the steps that trained on them."""
    rollouts = view.rollouts.to_table(
        columns=["experiences_version", "explorer_id", "explore_step", "rows"],
        filter=ds.field("model_version") == version,
    ).sort_by("experiences_version")
    used = view.step_rows(["step", "kind"], ds.field("model_version") == version)
    train = used.filter(pc.equal(used.column("kind"), "train"))
    trained_by_step = counts_by(train, "step")
    return {
        "weights_version": version,
        "produced_by_step": version if version > 0 else None,
        "initial_model": version == 0,
        "on_disk": version in weights_versions_on_disk(view.paths),
        "rollouts": rollouts.to_pylist(),
        "experiences": sum(rollouts.column("rows").to_pylist()),
        "trained": train.num_rows,
        "dropped": used.num_rows - train.num_rows,
        "steps": trained_by_step,
    }
