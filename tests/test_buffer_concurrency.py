"""Several writer processes append while the main process pins steps: nothing lost or doubled."""

from __future__ import annotations

import math
import multiprocessing
import time
from pathlib import Path

import pyarrow.compute as pc
from deltalake import DeltaTable

from tests.support.buffer import buffer_config, make_row
from trinity_dagster.buffer import (
    ExperienceWriter,
    PinResult,
    pin_batch,
    unconsumed_count,
)
from trinity_dagster.paths import RunPaths

WRITES_PER_PROCESS = 8


def _writer_process(root: str, worker: int) -> tuple[int, int, int]:
    """Write batches of good rows, one bad row and one eid every process also writes."""
    config = buffer_config(Path(root), train_batch_size=4, writer_max_retries=100)
    writer = ExperienceWriter(config)
    submitted = written = quarantined = 0
    for i in range(WRITES_PER_PROCESS):
        rows = [make_row(f"p{worker}-w{i}-{j}") for j in range(3)]
        rows.append(make_row(f"p{worker}-w{i}-bad", reward=math.nan))
        rows.append(make_row(f"shared-{i}"))  # exactly one process may win this eid
        report = writer.write(rows)
        submitted += len(rows)
        written += report.written
        quarantined += report.quarantined
    return submitted, written, quarantined


def test_concurrent_writers_and_pinner_account_for_every_row(tmp_path):
    config = buffer_config(tmp_path, train_batch_size=4, writer_max_retries=100)
    context = multiprocessing.get_context("spawn")
    steps = 0
    with context.Pool(3) as pool:
        pending = pool.starmap_async(_writer_process, [(str(tmp_path), w) for w in range(3)])
        while not pending.ready():
            if isinstance(pin_batch(config, steps + 1), PinResult):
                steps += 1
            else:
                time.sleep(0.05)
        reports = pending.get(timeout=300)
    while isinstance(pin_batch(config, steps + 1), PinResult):
        steps += 1
    assert steps >= 10

    submitted = sum(r[0] for r in reports)
    written = sum(r[1] for r in reports)
    quarantined = sum(r[2] for r in reports)
    assert submitted == 3 * WRITES_PER_PROCESS * 5
    # every process quarantines its bad rows; the shared eids are quarantined twice each
    assert quarantined == 3 * WRITES_PER_PROCESS + 2 * WRITES_PER_PROCESS

    paths = RunPaths.of(config.run_root)
    experiences = DeltaTable(str(paths.experiences)).to_pyarrow_table()
    batches = DeltaTable(str(paths.batches)).to_pyarrow_table()
    quarantine = DeltaTable(str(paths.quarantine)).to_pyarrow_table()
    eids = experiences.column("eid").to_pylist()
    consumed = batches.filter(pc.equal(batches.column("kind"), "train"))
    consumed_eids = consumed.column("eid").to_pylist()
    pending_count = unconsumed_count(config)

    assert len(eids) == written == len(set(eids))
    assert len(set(experiences.column("ingest_seq").to_pylist())) == written
    assert quarantine.num_rows == quarantined
    assert len(consumed_eids) == len(set(consumed_eids)) == 4 * steps
    assert set(consumed_eids) <= set(eids)
    assert pending_count == written - len(consumed_eids) < 4
    assert submitted == len(consumed_eids) + pending_count + quarantine.num_rows
    # ingest_seq order is commit order: each commit's rows share the version prefix
    commits = {seq >> 32 for seq in experiences.column("ingest_seq").to_pylist()}
    assert len(commits) == 3 * WRITES_PER_PROCESS
