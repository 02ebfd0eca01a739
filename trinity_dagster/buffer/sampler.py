"""Pinning the experiences of each train step into the `batches` table, idempotently.

A pin copies the chosen experience rows into `batches` with their step, position and the
sampler state after the step, in one Delta commit made with delta-rs' retries disabled
against the snapshot the pin was computed on: of two concurrent pinners one wins, the other
gets `CommitFailedError`, re-reads and returns the winner's rows. Replaying a step reads only
`batches`, so it survives compaction and vacuum of `experiences`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, write_deltalake

from trinity_dagster.buffer.quarantine import QuarantineRecord, append_quarantine
from trinity_dagster.buffer.scan import PendingScan, ScanChunk
from trinity_dagster.buffer.schema import BATCH_SCHEMA, EXPERIENCE_NAMES, PIN_STEP_KEY, TIMESTAMP
from trinity_dagster.buffer.state import SamplerState
from trinity_dagster.buffer.strategies import (
    BASE_COLUMNS,
    SampleContext,
    Selection,
    Strategy,
    get_strategy,
)
from trinity_dagster.buffer.tables import (
    HeldTable,
    open_table,
    retry_commits,
    table_dataset,
    writer_properties,
)
from trinity_dagster.buffer.validation import row_to_json
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff.wakeup import EXPLORER, wake
from trinity_dagster.paths import RunPaths


class NotEnoughDataError(RuntimeError):
    """A forced pin found fewer eligible experiences than a batch needs."""


class PinOrderError(ValueError):
    """A step was pinned before its predecessor."""


@dataclass(frozen=True)
class PinShortfall:
    """Too few eligible experiences for a batch: the normal answer while a step cannot be pinned."""

    have: int
    need: int
    # the experiences table version the try read (None: no table yet)
    source_version: int | None = field(default=None, compare=False)

    @property
    def message(self) -> str:
        """'have X, need Y'."""
        return f"have {self.have}, need {self.need}"


@dataclass(frozen=True)
class PinResult:
    """The rows pinned to `step`: eids in batch order, what was read, dropped, and the state.

    `rows` holds the pinned train rows (experience schema, batch order) and `batch_version`
    the `batches` table version of the pin when this call pinned them, so a caller can
    describe the batch without reading it back; None otherwise.
    """

    step: int
    eids: list[str]
    source_version: int
    strategy: str
    state: SamplerState
    dropped: list[str]
    already_pinned: bool
    rows: pa.Table | None = field(default=None, repr=False, compare=False)
    batch_version: int | None = field(default=None, compare=False)

    @property
    def newly_pinned(self) -> bool:
        """True when this call committed the pin (False: the step was pinned before)."""
        return not self.already_pinned

    def as_metadata(self) -> dict[str, object]:
        """Plain values for the `experience_batch` materialization."""
        return {
            "step": self.step,
            "rows": len(self.eids),
            "source_version": self.source_version,
            "strategy": self.strategy,
            "dropped": len(self.dropped),
            "already_pinned": self.already_pinned,
        }


def _step_rows(batches: DeltaTable, steps: list[int], columns: list[str]) -> pa.Table:
    low, high = min(steps), max(steps)
    dataset = table_dataset(batches, "step", low, high)
    return dataset.to_table(columns=columns, filter=ds.field("step").isin(steps))


def pinned_columns(paths: RunPaths, step: int, columns: list[str]) -> pa.Table:
    """`columns` of the train rows pinned to `step`, in batch order (empty: none pinned)."""
    batches = open_table(paths.batches)
    if batches is None:
        return pa.table({name: pa.array([]) for name in columns})
    rows = _step_rows(batches, [step], [*columns, "kind", "position"])
    rows = rows.filter(pc.equal(rows.column("kind"), "train")).sort_by("position")
    return rows.select(columns)


def _existing(batches: DeltaTable, step: int) -> PinResult:
    rows = _step_rows(
        batches, [step], ["eid", "kind", "position", "source_version", "strategy", "sampler_state"]
    )
    rows = rows.sort_by("position")
    kinds = rows.column("kind").to_pylist()
    eids = rows.column("eid").to_pylist()
    return PinResult(
        step=step,
        eids=[e for e, k in zip(eids, kinds, strict=True) if k == "train"],
        source_version=rows.column("source_version")[0].as_py(),
        strategy=rows.column("strategy")[0].as_py(),
        state=SamplerState.from_json(rows.column("sampler_state")[0].as_py()),
        dropped=[e for e, k in zip(eids, kinds, strict=True) if k != "train"],
        already_pinned=True,
    )


def sampler_state(config: TrinityConfig, step: int) -> SamplerState:
    """The sampler state recorded with step `step` (0: the initial state)."""
    if step == 0:
        return SamplerState()
    return state_in(open_table(RunPaths.of_config(config).batches), step)


def state_in(batches: DeltaTable | None, step: int) -> SamplerState:
    """The sampler state recorded with step `step` in `batches` (None: no table yet); step 0
    has the initial state."""
    if step == 0:
        return SamplerState()
    if batches is None:
        raise LookupError(f"step {step} is not pinned: no batches table yet")
    rows = _step_rows(batches, [step], ["sampler_state"])
    if rows.num_rows == 0:
        raise LookupError(f"step {step} is not pinned in {batches.table_uri}")
    return SamplerState.from_json(rows.column("sampler_state")[0].as_py())


def _advance(
    state: SamplerState,
    step: int,
    source_version: int,
    candidates: pa.Table,
    boundary: int,
    selection: Selection,
    reuse_limit: int,
) -> SamplerState:
    """The state after this pin: watermark at the oldest row still pending."""
    uses = dict(state.uses)
    resolved = set(state.done)
    for eid in selection.train:
        uses[eid] = uses.get(eid, 0) + 1
        if uses[eid] >= reuse_limit:
            resolved.add(eid)
    resolved.update(eid for eid, _ in selection.dropped)
    eids = candidates.column("eid").to_pylist()
    seqs = candidates.column("ingest_seq").to_pylist()
    seq_of = dict(zip(eids, seqs, strict=True))
    pending = [s for e, s in zip(eids, seqs, strict=True) if e not in resolved]
    watermark = min([*pending, boundary])
    return SamplerState(
        step=step,
        watermark=watermark,
        source_version=source_version,
        done=tuple(sorted(e for e in resolved if seq_of.get(e, watermark) >= watermark)),
        uses={e: n for e, n in sorted(uses.items()) if e not in resolved},
    )


def pin_batch(
    config: TrinityConfig, step: int, *, current_version: int | None = None, force: bool = False
) -> PinResult | PinShortfall:
    """Pin the experiences of train step `step` (>= 1), or return the rows already pinned.

    `current_version` is the weights version the step trains from (default `step - 1`).
    Returns `PinShortfall` when too few eligible rows are pending; with `force=True` that
    raises `NotEnoughDataError` instead.
    """
    return BatchPinner(config).pin(step, current_version=current_version, force=force)


class BatchPinner:
    """Pins steps for one caller (the trainer loop), keeping both tables open between pins.

    Each pin brings the held tables up to date (`HeldTable`) instead of opening them afresh.
    After a pin of its own it keeps the sampler state it committed: while `batches` has no
    commit after that one, the next step's pin takes the state from memory instead of reading
    `batches`. Any other commit (another pinner, maintenance) sends it back to reading.
    """

    def __init__(self, config: TrinityConfig) -> None:
        self.config = config
        self.paths = RunPaths.of_config(config)
        self._batches = HeldTable(self.paths.batches, create_with=BATCH_SCHEMA)
        self._experiences = HeldTable(self.paths.experiences)
        self._own: PinResult | None = None  # this pinner's last pin, at `batch_version`

    def pin(
        self, step: int, *, current_version: int | None = None, force: bool = False
    ) -> PinResult | PinShortfall:
        """What `pin_batch` does, with the tables kept open."""
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        config = self.config
        context = SampleContext(
            config=config, current_version=step - 1 if current_version is None else current_version
        )
        result, stale = retry_commits(
            lambda: self._pin_once(step, context),
            config.buffer.writer_max_retries,
            f"pin of step {step}",
        )
        append_quarantine(
            self.paths.quarantine,
            stale,
            source="sampler",
            step=step,
            max_retries=config.buffer.writer_max_retries,
        )
        if isinstance(result, PinShortfall) and force:
            raise NotEnoughDataError(f"cannot pin step {step}: {result.message}")
        if config.buffer.capacity is not None and isinstance(result, PinResult):
            wake(self.paths.wakeup, EXPLORER)  # an explorer waiting for room looks now
        return result

    def _state_before(self, batches: DeltaTable, step: int) -> SamplerState | PinResult:
        """The sampler state after step `step - 1`, or the rows of `step` if already pinned."""
        own = self._own
        if own is not None and own.step == step - 1 and own.batch_version == batches.version():
            return own.state  # nothing was committed after this pinner's pin of step - 1
        around = _step_rows(batches, [step - 1, step], ["step", "sampler_state"])
        known = around.column("step").to_pylist()
        if step in known:
            return _existing(batches, step)
        if step > 1 and step - 1 not in known:
            raise PinOrderError(
                f"cannot pin step {step}: step {step - 1} is not pinned (steps are pinned in order)"
            )
        if step == 1:
            return SamplerState()
        return SamplerState.from_json(around.column("sampler_state")[known.index(step - 1)].as_py())

    def _pin_once(
        self, step: int, context: SampleContext
    ) -> tuple[PinResult | PinShortfall, list[QuarantineRecord]]:
        """One try at pinning `step`: the pin (or the rows already pinned, or the shortfall),
        and the stale rows the pin drops. A commit conflict raises for `retry_commits`."""
        batches = self._batches.get()
        assert batches is not None  # created if absent
        state = self._state_before(batches, step)
        if isinstance(state, PinResult):
            return state, []
        experiences = self._experiences.get()
        if experiences is None:
            return PinShortfall(have=0, need=context.config.buffer.train_batch_size), []
        strategy = get_strategy(context.config.buffer.sample_strategy)
        source_version = experiences.version()
        scan = PendingScan(experiences, state.watermark, BASE_COLUMNS + list(strategy.columns))
        selection, chunk = _select(scan, state, strategy, context)
        if not selection.train or chunk is None:
            need = context.config.buffer.train_batch_size
            return PinShortfall(selection.eligible_rows, need, source_version), []
        new_state = _advance(
            state,
            step,
            source_version,
            chunk.rows,
            chunk.boundary,
            selection,
            context.config.buffer.reuse_limit,
        )
        dropped = [eid for eid, _ in selection.dropped]
        rows = scan.read_rows(selection.train + dropped)
        _append_pin(batches, step, rows, len(selection.train), source_version, strategy, new_state)
        pinned = PinResult(
            step=step,
            eids=selection.train,
            source_version=source_version,
            strategy=strategy.name,
            state=new_state,
            dropped=dropped,
            already_pinned=False,
            rows=rows.slice(0, len(selection.train)).select(list(EXPERIENCE_NAMES)),
            batch_version=batches.version(),
        )
        self._own = pinned
        stale = [
            QuarantineRecord(eid, "model_version", reason, row_to_json(row))
            for (eid, reason), row in zip(
                selection.dropped, rows.slice(len(selection.train)).to_pylist(), strict=True
            )
        ]
        return pinned, stale


def _select(
    scan: PendingScan, state: SamplerState, strategy: Strategy, context: SampleContext
) -> tuple[Selection, ScanChunk | None]:
    """The strategy's selection from the pending rows past the pins of `state`, chunk by
    chunk until one gives a batch (a full-scan strategy sees every pending row at once), and
    the chunk it came from."""
    selection, chunk = Selection(), None
    done = pa.array(state.done, pa.string())
    for chunk in scan.chunks():
        if strategy.full_scan and not chunk.exhausted:
            continue
        pending = chunk.rows.filter(pc.invert(pc.is_in(chunk.rows.column("eid"), done)))
        selection = strategy.select(pending, context)
        if selection.train:
            break
    return selection, chunk


def _append_pin(
    batches: DeltaTable,
    step: int,
    rows: pa.Table,
    trained: int,
    source_version: int,
    strategy: Strategy,
    state: SamplerState,
) -> None:
    """Commit `rows` as step `step` of `batches`: the first `trained` to train on, the rest
    dropped as stale, each with the sampler state after the pin."""
    n = rows.num_rows
    extra = {
        "step": pa.array([step] * n, pa.int64()),
        "position": pa.array(range(n), pa.int32()),
        "kind": pa.array(["train"] * trained + ["stale"] * (n - trained), pa.string()),
        "source_version": pa.array([source_version] * n, pa.int64()),
        "strategy": pa.array([strategy.name] * n, pa.string()),
        "sampler_state": pa.array([state.to_json()] * n, pa.string()),
        "pinned_at": pa.array([dt.datetime.now(dt.UTC)] * n, TIMESTAMP),
    }
    data = pa.Table.from_arrays(
        [rows.column(c) for c in EXPERIENCE_NAMES] + list(extra.values()), schema=BATCH_SCHEMA
    )
    write_deltalake(
        batches,
        data,
        mode="append",
        writer_properties=writer_properties(),
        commit_properties=CommitProperties(
            max_commit_retries=0, custom_metadata={PIN_STEP_KEY: str(step)}
        ),
    )
