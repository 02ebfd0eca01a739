"""Benchmark of the experience buffer: pin time against table size, and append throughput.

Pin time is measured at 10k, 100k and 1M experiences (the 10k table is the baseline; the
goal is `ratio_1m_10k <= 1.5`). The big tables are filled with large arrow batches numbered
like the writer does; append throughput goes through the real `ExperienceWriter`, with a
raw `write_deltalake` of the same rows as its baseline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import write_deltalake

from trinity_dagster.buffer import EXPERIENCE_SCHEMA, ExperienceWriter, PinResult, pin_batch
from trinity_dagster.buffer.schema import seq_floor
from trinity_dagster.buffer.tables import open_or_create, writer_properties
from trinity_dagster.config import TrinityConfig, config_from_dict
from trinity_dagster.paths import RunPaths

PROMPT, RESPONSE = 2, 2
FILL_BATCH = 100_000


def _config(root: Path, batch: int) -> TrinityConfig:
    return config_from_dict(
        {
            "run_root": str(root),
            "buffer": {"train_batch_size": batch, "batch_unit": "rows"},
            "trainer": {"micro_batch_size": 1},
        }
    )


def _filler(start: int, n: int, version: int) -> pa.Table:
    """`n` short experiences numbered as a commit at `version` would number them."""
    width = PROMPT + RESPONSE
    ids = np.arange(start, start + n)

    def lists(values: np.ndarray, per_row: int) -> pa.Array:
        offsets = pa.array(np.arange(0, n * per_row + 1, per_row, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(values))

    eids = pa.array([f"e{i}" for i in ids.tolist()])
    now = dt.datetime.now(dt.UTC)
    columns = {
        "eid": eids,
        "task_id": eids,
        "group_id": eids,
        "explorer_id": pa.array(["bench"] * n),
        "tokens": lists(np.tile(np.arange(1, width + 1, dtype=np.int32), n), width),
        "prompt_length": pa.array(np.full(n, PROMPT, dtype=np.int32)),
        "action_mask": lists(np.ones(n * RESPONSE, dtype=bool), RESPONSE),
        "logprobs": lists(np.full(n * RESPONSE, -0.5, dtype=np.float32), RESPONSE),
        "reward": pa.array(np.ones(n)),
        "advantages": pa.nulls(n, pa.list_(pa.float32())),
        "returns": pa.nulls(n, pa.list_(pa.float32())),
        "model_version": pa.array(np.zeros(n, dtype=np.int64)),
        "created_at": pa.array([now] * n, EXPERIENCE_SCHEMA.field("created_at").type),
        "info": pa.array(["{}"] * n),
        "ingest_seq": pa.array(seq_floor(version) + np.arange(n, dtype=np.int64)),
    }
    return pa.Table.from_pydict(columns, schema=EXPERIENCE_SCHEMA)


def _fill(config: TrinityConfig, rows: int) -> None:
    table = open_or_create(RunPaths.of_config(config).experiences, EXPERIENCE_SCHEMA)
    for start in range(0, rows, FILL_BATCH):
        n = min(FILL_BATCH, rows - start)
        write_deltalake(
            table,
            _filler(start, n, table.version() + 1),
            mode="append",
            writer_properties=writer_properties(),
        )
        table.update_incremental()


def _pin_times(configs: dict[str, TrinityConfig], pins: int) -> dict[str, list[float]]:
    """Wall times (ms) of consecutive pins, the sizes taken in turn so load hits all alike."""
    times: dict[str, list[float]] = {label: [] for label in configs}
    for step in range(1, pins + 2):
        for label, config in configs.items():
            start = time.perf_counter()
            result = pin_batch(config, step)
            elapsed = (time.perf_counter() - start) * 1000
            if not isinstance(result, PinResult):
                raise RuntimeError(f"benchmark pin of step {step} at {label}: {result}")
            if step > 1:  # step 1 is the warm-up of each table
                times[label].append(elapsed)
    return times


def _append_rates(root: Path, writes: int, rows: int) -> tuple[float, float]:
    """Rows/s through ExperienceWriter, and through a raw write_deltalake of the same rows."""
    config = _config(root / "writer", 32)
    base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    batches = [
        [
            {
                "eid": f"w{w}-{i}",
                "task_id": f"t{i}",
                "group_id": f"g{i}",
                "tokens": list(range(1, 25)),
                "prompt_length": 16,
                "action_mask": [True] * 8,
                "logprobs": [-0.5] * 8,
                "reward": 1.0,
                "model_version": 0,
                "created_at": base,
            }
            for i in range(rows)
        ]
        for w in range(writes)
    ]
    writer = ExperienceWriter(config)
    start = time.perf_counter()
    for batch in batches:
        report = writer.write(batch)
        if report.written != rows:
            raise RuntimeError(f"benchmark write rejected rows: {report.reasons[:3]}")
    validated = writes * rows / (time.perf_counter() - start)
    raw_path = root / "raw"
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        table = pa.Table.from_pylist(
            [{**row, "info": "{}", "explorer_id": "", "ingest_seq": i} for row in batch],
            schema=EXPERIENCE_SCHEMA,
        )
        write_deltalake(str(raw_path), table, mode="append")
    raw = writes * rows / (time.perf_counter() - start)
    return validated, raw


def main() -> None:
    """Run the benchmark and print its figures, the last line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pins", type=int, default=15, help="measured pins per table size")
    parser.add_argument("--batch", type=int, default=32, help="rows per pinned batch")
    args = parser.parse_args()
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_buffer_") as tmp:
        root = Path(tmp)
        configs = {}
        for label, rows in (("10k", 10_000), ("100k", 100_000), ("1m", 1_000_000)):
            configs[label] = _config(root / label, args.batch)
            start = time.perf_counter()
            _fill(configs[label], rows)
            print(f"filled {rows} rows in {time.perf_counter() - start:.1f}s", flush=True)
        for label, times in _pin_times(configs, args.pins).items():
            figures[f"pin_ms_{label}"] = round(statistics.median(times), 2)
            figures[f"pin_min_ms_{label}"] = round(min(times), 2)
            print(f"pin at {label}: median {figures[f'pin_ms_{label}']} ms", flush=True)
        validated, raw = _append_rates(root, writes=20, rows=256)
    figures["ratio_1m_10k"] = round(figures["pin_ms_1m"] / figures["pin_ms_10k"], 3)
    figures["append_rows_per_s"] = round(validated, 1)
    figures["raw_append_rows_per_s"] = round(raw, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
