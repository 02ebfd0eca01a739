"""Benchmark of the lineage ledger: the three `trinity-dagster lineage` questions on a
10,000-step run (goal: each <= 1 s), and bringing the ledger up to date after 50 more steps.

The ledger is built as `update_ledger` leaves it after a long run: 10,000 steps of 256
experiences (2.56M rows, eids as the built-in explorer names them, produced one or two weights
versions back), appended 50 steps at a time and compacted as it grows, plus one rollouts row
per explore step. Then 50 more steps are pinned into a real `batches` table (and their
experiences into `experiences`) and `update_ledger` takes them in. The baseline is one plain
read of every column of the steps table: the cost of looking at the whole ledger once.
`cli_eid_s` is one whole `trinity-dagster lineage --eid X --json` process (Python start and
imports included).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from trinity_dagster.buffer.sampler import PIN_STEP_KEY
from trinity_dagster.buffer.schema import BATCH_SCHEMA, EXPERIENCE_SCHEMA, seq_floor
from trinity_dagster.buffer.state import SamplerState
from trinity_dagster.buffer.tables import open_or_create, table_dataset, writer_properties
from trinity_dagster.buffer.writer import EXPLORE_STEP_KEY
from trinity_dagster.lineage.ledger import (
    ROLLOUTS_SCHEMA,
    STEPS_SCHEMA,
    compact_if_fragmented,
    update_ledger,
)
from trinity_dagster.lineage.queries import (
    LedgerView,
    checkpoint_lineage,
    eid_lineage,
    weights_lineage,
)
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import write_record

ROWS = 256
CHUNK = 50  # steps per ledger update while building
EXPLORER = "builtin"


def eids_of(steps: np.ndarray) -> pa.Array:
    """The built-in explorer's eids of explore steps `steps` (ROWS each)."""
    index = np.tile(np.arange(ROWS), len(steps))
    step = np.repeat(steps, ROWS)
    return pc.binary_join_element_wise(
        EXPLORER, pa.array(step).cast(pa.string()), pa.array(index).cast(pa.string()), ":"
    )


def producing_versions(steps: np.ndarray) -> np.ndarray:
    """Half of each step's rows from the previous weights, half from the ones before."""
    step = np.repeat(steps, ROWS)
    back = 1 + (np.tile(np.arange(ROWS), len(steps)) % 2)
    return np.maximum(step - back, 0)


def ledger_chunk(first: int, last: int) -> pa.Table:
    """Ledger rows of steps first..last: explore step s feeds train step s, in order."""
    steps = np.arange(first, last + 1)
    n = len(steps) * ROWS
    step = np.repeat(steps, ROWS)
    seq = [seq_floor(int(s)) for s in steps]
    ingest = np.repeat(np.array(seq, dtype=np.int64), ROWS) + np.tile(np.arange(ROWS), len(steps))
    return pa.table(
        {
            "step": pa.array(step, pa.int64()),
            "position": pa.array(np.tile(np.arange(ROWS, dtype=np.int32), len(steps))),
            "kind": pa.array(["train"] * n),
            "eid": eids_of(steps),
            "model_version": pa.array(producing_versions(steps), pa.int64()),
            "ingest_seq": pa.array(ingest, pa.int64()),
            "source_version": pa.array(step, pa.int64()),
            "batch_version": pa.array(step, pa.int64()),
            "watermark": pa.array(np.repeat(np.array(seq) + ROWS, ROWS), pa.int64()),
        },
        schema=STEPS_SCHEMA,
    )


def build_ledger(paths: RunPaths, steps: int) -> None:
    """The ledger of a `steps`-step run, appended and compacted as `update_ledger` does."""
    ledger = open_or_create(paths.ledger_steps, STEPS_SCHEMA)
    for first in range(1, steps + 1, CHUNK):
        last = min(first + CHUNK - 1, steps)
        write_deltalake(
            ledger, ledger_chunk(first, last), mode="append", writer_properties=writer_properties()
        )
        compact_if_fragmented(paths.ledger_steps)
        ledger = DeltaTable(paths.ledger_steps)
    explore = np.arange(1, steps + 1)
    rollouts = pa.table(
        {
            "experiences_version": pa.array(explore, pa.int64()),
            "explorer_id": pa.array([EXPLORER] * steps),
            "explore_step": pa.array(explore, pa.int64()),
            "model_version": pa.array(np.maximum(explore - 1, 0), pa.int64()),
            "rows": pa.array([ROWS] * steps, pa.int64()),
        },
        schema=ROLLOUTS_SCHEMA,
    )
    rollout_table = open_or_create(paths.ledger_rollouts, ROLLOUTS_SCHEMA)
    write_deltalake(rollout_table, rollouts, mode="append", writer_properties=writer_properties())
    for step in range(1, steps + 1):
        write_record(paths, {"step": step, "parent_step": step - 1})


def experience_rows(step: int, version: int) -> pa.Table:
    """ROWS short experiences of explore step `step`, numbered as commit `version` would."""
    eids = eids_of(np.array([step]))
    now = dt.datetime.now(dt.UTC)
    tokens = pa.array([[1, 2, 3, 4]] * ROWS, pa.list_(pa.int32()))
    return pa.table(
        {
            "eid": eids,
            "task_id": eids,
            "group_id": eids,
            "explorer_id": pa.array([EXPLORER] * ROWS),
            "tokens": tokens,
            "prompt_length": pa.array([2] * ROWS, pa.int32()),
            "action_mask": pa.array([[True, True]] * ROWS, pa.list_(pa.bool_())),
            "logprobs": pa.array([[-0.5, -0.5]] * ROWS, pa.list_(pa.float32())),
            "reward": pa.array(np.zeros(ROWS)),
            "advantages": pa.nulls(ROWS, pa.list_(pa.float32())),
            "returns": pa.nulls(ROWS, pa.list_(pa.float32())),
            "model_version": pa.array([step - 1] * ROWS, pa.int64()),
            "created_at": pa.array([now] * ROWS, EXPERIENCE_SCHEMA.field("created_at").type),
            "info": pa.array(["{}"] * ROWS),
            "ingest_seq": pa.array(seq_floor(version) + np.arange(ROWS), pa.int64()),
        },
        schema=EXPERIENCE_SCHEMA,
    )


def pin_more(paths: RunPaths, first: int, count: int) -> None:
    """Steps first..first+count-1 as real commits: experiences written, then pinned."""
    experiences = open_or_create(paths.experiences, EXPERIENCE_SCHEMA)
    batches = open_or_create(paths.batches, BATCH_SCHEMA)
    for step in range(first, first + count):
        rows = experience_rows(step, experiences.version() + 1)
        write_deltalake(
            experiences,
            rows,
            mode="append",
            commit_properties=CommitProperties(custom_metadata={EXPLORE_STEP_KEY: str(step)}),
        )
        state = SamplerState(step=step, watermark=seq_floor(experiences.version() + 1))
        extra = {
            "step": pa.array([step] * ROWS, pa.int64()),
            "position": pa.array(range(ROWS), pa.int32()),
            "kind": pa.array(["train"] * ROWS),
            "source_version": pa.array([experiences.version()] * ROWS, pa.int64()),
            "strategy": pa.array(["fifo"] * ROWS),
            "sampler_state": pa.array([state.to_json()] * ROWS),
            "pinned_at": pa.array(
                [dt.datetime.now(dt.UTC)] * ROWS, BATCH_SCHEMA.field("pinned_at").type
            ),
        }
        pinned = pa.Table.from_arrays(
            list(rows.columns) + list(extra.values()), schema=BATCH_SCHEMA
        )
        write_deltalake(
            batches,
            pinned,
            mode="append",
            commit_properties=CommitProperties(custom_metadata={PIN_STEP_KEY: str(step)}),
        )
        write_record(paths, {"step": step, "parent_step": step - 1})


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of `repeats` calls of `fn`, and its last answer."""
    times, answer = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        answer = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="steps in the ledger")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per query")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lineage-") as scratch:
        paths = RunPaths.of(Path(scratch) / "run")
        started = time.perf_counter()
        build_ledger(paths, args.steps)
        build_s = time.perf_counter() - started
        print(f"built a {args.steps}-step ledger ({args.steps * ROWS} rows) in {build_s:.1f} s")
        files = len(DeltaTable(paths.ledger_steps).file_uris())
        full_read_s, _ = timed(
            lambda: table_dataset(DeltaTable(paths.ledger_steps)).to_table(), args.repeats
        )
        middle = args.steps // 2
        checkpoint_s, ckpt = timed(
            lambda: checkpoint_lineage(LedgerView.open(paths), args.steps), args.repeats
        )
        eid = f"{EXPLORER}:{middle}:{ROWS // 2}"
        eid_s, (found,) = timed(lambda: eid_lineage(LedgerView.open(paths), [eid]), args.repeats)
        weights_s, used = timed(
            lambda: weights_lineage(LedgerView.open(paths), middle), args.repeats
        )
        assert ckpt["steps"] == args.steps and not ckpt["missing_steps"], ckpt["missing_steps"]
        assert found["uses"] == [{"step": middle, "kind": "train"}], found
        assert used["trained"] == ROWS and sorted(used["steps"]) == [middle + 1, middle + 2], used
        # 50 more steps pinned for real, then taken into the ledger
        pin_more(paths, args.steps + 1, CHUNK)
        started = time.perf_counter()
        update = update_ledger(paths)
        update_s = time.perf_counter() - started
        assert update.steps == (args.steps + 1, args.steps + CHUNK), update
        command = [sys.executable, "-m", "trinity_dagster.cli", "lineage"]
        command += ["--run-root", str(paths.root), "--eid", eid, "--json"]
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        cli_s = time.perf_counter() - started
    figures = {
        "steps": args.steps,
        "ledger_rows": args.steps * ROWS,
        "ledger_files": files,
        "query_checkpoint_s": round(checkpoint_s, 4),
        "query_eid_s": round(eid_s, 4),
        "query_weights_s": round(weights_s, 4),
        "full_read_s": round(full_read_s, 4),
        "ratio_checkpoint_vs_full_read": round(checkpoint_s / full_read_s, 3),
        "ratio_eid_vs_full_read": round(eid_s / full_read_s, 3),
        "ratio_weights_vs_full_read": round(weights_s / full_read_s, 3),
        f"update_{CHUNK}_steps_s": round(update_s, 4),
        "cli_eid_s": round(cli_s, 3),
        "goal_query_s": 1.0,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
