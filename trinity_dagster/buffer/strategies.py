"""Sample strategies by name: which pending units (rows or whole GRPO groups) a step takes.

Units: with `buffer.batch_unit == "rows"` every row is a unit; with `"groups"` the pending
rows of a `group_id`, in `ingest_seq` order, are cut into chunks of `algorithm.repeat_times`
rows and each full chunk is a unit (an incomplete chunk is not eligible). A unit's age is
the `ingest_seq` of its last row, i.e. when it became complete.

- `fifo`: oldest units first.
- `staleness_control`: like fifo, but every row whose `model_version` is more than
  `buffer.max_staleness` behind the current weights version is dropped (with its whole unit).
- `priority`: highest unit priority first (ties: oldest first). A row's priority is the
  number `info["priority"]` if present, else `abs(reward)`; a unit's is the mean of its rows.
  A row may be sampled up to `buffer.reuse_limit` times, never twice in one step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from trinity_dagster.config import TrinityConfig

BASE_COLUMNS = ["eid", "group_id", "ingest_seq", "model_version"]


@dataclass(frozen=True)
class SampleContext:
    """What a strategy needs besides the candidates."""

    config: TrinityConfig
    current_version: int


@dataclass
class Selection:
    """Chosen train eids in batch order, dropped (eid, reason) pairs, eligible row count."""

    train: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    eligible_rows: int = 0


@dataclass(frozen=True)
class Strategy:
    """A named strategy: extra columns it reads, whether it must see every pending row."""

    name: str
    columns: tuple[str, ...]
    full_scan: bool
    select: Callable[[pa.Table, SampleContext], Selection]


def _units(candidates: pa.Table, config: TrinityConfig) -> list[list[int]]:
    """Candidate row indices grouped into complete units, oldest (by last row) first."""
    seqs = candidates.column("ingest_seq").to_pylist()
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    if config.buffer.batch_unit == "rows":
        return [[i] for i in order]
    size = config.algorithm.repeat_times
    by_group: dict[str, list[int]] = {}
    groups = candidates.column("group_id").to_pylist()
    for i in order:
        by_group.setdefault(groups[i], []).append(i)
    units = [
        rows[start : start + size]
        for rows in by_group.values()
        for start in range(0, len(rows) - size + 1, size)
    ]
    units.sort(key=lambda unit: seqs[unit[-1]])
    return units


def _take(candidates: pa.Table, units: list[list[int]], config: TrinityConfig) -> Selection:
    eids = candidates.column("eid").to_pylist()
    eligible = sum(len(u) for u in units)
    need = config.buffer.train_batch_size
    if eligible < need:
        return Selection(eligible_rows=eligible)
    chosen: list[str] = []
    for unit in units:
        if len(chosen) >= need:
            break
        chosen.extend(eids[i] for i in unit)
    return Selection(train=chosen, eligible_rows=eligible)


def _fifo(candidates: pa.Table, ctx: SampleContext) -> Selection:
    return _take(candidates, _units(candidates, ctx.config), ctx.config)


def _staleness_control(candidates: pa.Table, ctx: SampleContext) -> Selection:
    limit = ctx.config.buffer.max_staleness
    versions = candidates.column("model_version").to_pylist()
    eids = candidates.column("eid").to_pylist()
    stale = (
        set()
        if limit is None
        else {i for i, v in enumerate(versions) if ctx.current_version - v > limit}
    )
    fresh_units, dropped_rows = [], set(stale)
    for unit in _units(candidates, ctx.config):
        if stale.intersection(unit):
            dropped_rows.update(unit)
        else:
            fresh_units.append(unit)
    selection = _take(candidates, fresh_units, ctx.config)
    selection.dropped = [
        (
            eids[i],
            f"stale: model_version {versions[i]} is {ctx.current_version - versions[i]} "
            f"behind current weights version {ctx.current_version} "
            f"(buffer.max_staleness {limit})"
            if i in stale
            else f"stale: a row of its group is more than buffer.max_staleness {limit} "
            f"behind current weights version {ctx.current_version}",
        )
        for i in sorted(dropped_rows)
    ]
    return selection


def row_priority(reward: float, info: str) -> float:
    """`info["priority"]` if it is a finite number, else `abs(reward)`."""
    try:
        value = json.loads(info).get("priority")
    except (ValueError, AttributeError):
        value = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            priority = float(value)
        except OverflowError:  # an integer beyond any float
            return abs(reward)
        if math.isfinite(priority):
            return priority
    return abs(reward)


def _priority(candidates: pa.Table, ctx: SampleContext) -> Selection:
    rewards = candidates.column("reward").to_pylist()
    infos = candidates.column("info").to_pylist()
    seqs = candidates.column("ingest_seq").to_pylist()
    prio = [row_priority(r, s) for r, s in zip(rewards, infos, strict=True)]
    units = _units(candidates, ctx.config)
    units.sort(key=lambda u: (-sum(prio[i] for i in u) / len(u), seqs[u[-1]]))
    return _take(candidates, units, ctx.config)


STRATEGIES: dict[str, Strategy] = {
    "fifo": Strategy("fifo", (), full_scan=False, select=_fifo),
    "staleness_control": Strategy(
        "staleness_control", (), full_scan=False, select=_staleness_control
    ),
    "priority": Strategy("priority", ("reward", "info"), full_scan=True, select=_priority),
}


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, or a ValueError listing the known ones."""
    if name not in STRATEGIES:
        raise ValueError(
            f"buffer.sample_strategy: unknown strategy {name!r} (known: {sorted(STRATEGIES)})"
        )
    return STRATEGIES[name]
