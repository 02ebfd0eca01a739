"""Reading pending experiences in `ingest_seq` order, touching only row groups at or above a seq."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from trinity_dagster.buffer.schema import EXPERIENCE_SCHEMA, seq_floor
from trinity_dagster.buffer.tables import DataFiles, add_actions


@dataclass(frozen=True)
class ScanChunk:
    """All rows with `watermark <= ingest_seq < boundary`; `exhausted` when there are no more."""

    rows: pa.Table
    boundary: int
    exhausted: bool


class PendingScan:
    """Rows of one experiences snapshot at/above a watermark, oldest row groups first.

    The data files and their `ingest_seq` min/max come from the Delta log; files whose max is
    below the watermark are never opened, the others only when they may hold the next-oldest
    rows, and inside a file row groups are read one at a time (pruned by their statistics).
    The cost of a pin therefore depends on how many rows are pending, not on the table size.
    """

    def __init__(self, table: DeltaTable, watermark: int, columns: Sequence[str]) -> None:
        self.end = seq_floor(table.version() + 1)
        self._watermark = watermark
        self._columns = list(dict.fromkeys(["eid", "ingest_seq", *columns]))
        self._data_files = DataFiles(table)
        actions = add_actions(table)
        self._files: list[tuple[int, str]] = []
        if actions.num_rows:
            for path, low, high in zip(
                actions.column("path").to_pylist(),
                actions.column("min.ingest_seq").to_pylist(),
                actions.column("max.ingest_seq").to_pylist(),
                strict=True,
            ):
                if high is None or high >= watermark:
                    self._files.append((watermark if low is None else max(low, watermark), path))
        self._read: list[ds.Fragment] = []

    def chunks(self) -> Iterator[ScanChunk]:
        """Growing exact prefixes: every row with `watermark <= seq < boundary` is in each."""
        condition = ds.field("ingest_seq") >= self._watermark
        heap: list[tuple[int, int, str | ds.Fragment]] = [
            (low, i, path) for i, (low, path) in enumerate(self._files)
        ]
        heapq.heapify(heap)
        counter = len(heap)
        parts: list[pa.Table] = []
        while heap:
            _, _, item = heapq.heappop(heap)
            if isinstance(item, str):
                fragment = self._data_files.open(item)
                for group in fragment.split_by_row_group(filter=condition):
                    stats = group.row_groups[0].statistics.get("ingest_seq") or {}
                    low = int(stats.get("min", self._watermark))
                    heapq.heappush(heap, (low, counter, group))
                    counter += 1
                continue
            parts.append(item.to_table(columns=self._columns))
            self._read.append(item)
            boundary = heap[0][0] if heap else self.end
            rows = pa.concat_tables(parts)
            seqs = rows.column("ingest_seq")
            keep = pc.and_(pc.greater_equal(seqs, self._watermark), pc.less(seqs, boundary))
            yield ScanChunk(rows.filter(keep), boundary, not heap)
        if not parts:
            schema = pa.schema([EXPERIENCE_SCHEMA.field(c) for c in self._columns])
            yield ScanChunk(schema.empty_table(), self.end, True)

    def read_rows(self, eids: Sequence[str]) -> pa.Table:
        """Full rows of `eids` (all among the rows scanned so far), in the order given."""
        condition = ds.field("eid").isin(list(eids))
        found = [fragment.to_table(filter=condition) for fragment in self._read]
        rows = pa.concat_tables(found) if found else EXPERIENCE_SCHEMA.empty_table()
        index = {eid: i for i, eid in enumerate(rows.column("eid").to_pylist())}
        missing = [e for e in eids if e not in index]
        if missing:
            raise LookupError(f"experiences table: pinned eids not found: {missing[:5]}")
        return rows.take(pa.array([index[e] for e in eids], pa.int64()))
