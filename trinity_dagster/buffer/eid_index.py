"""Which eids the experiences table holds, in 8 bytes per eid.

A writer checks every new row's eid against all the rows committed before. Python strings in
a set take ~120 bytes an eid: over 1 GB at 50,000 steps of 256 rows. The index keeps each eid's
64-bit hash instead (Python's `hash`, so an index is only good in the process that built
it) in a sorted array, and the writer confirms each hit against the table itself, so a new
eid that shares a stored one's hash is still written.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# Hashes added since the last merge into the sorted array: a merge copies the array once.
MERGE_AT = 1 << 16


class EidIndex:
    """The hashes of the eids added so far; `candidates` are the eids that may be among them."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.int64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        """How many distinct hashes the index holds."""
        self._merge()
        return len(self._sorted)

    @property
    def nbytes(self) -> int:
        """The memory of the merged hashes, in bytes."""
        return self._sorted.nbytes

    def add(self, eids: Iterable[str]) -> None:
        """Record `eids` as stored."""
        self._recent.update(hash(eid) for eid in eids)
        if len(self._recent) >= MERGE_AT:
            self._merge()

    def candidates(self, eids: list[str]) -> list[str]:
        """The eids of `eids` whose hash the index holds: every stored one, and rarely a new
        one whose hash collides with a stored eid's (about n / 2**64 each, n stored)."""
        hashes = np.fromiter((hash(eid) for eid in eids), dtype=np.int64, count=len(eids))
        held = np.zeros(len(eids), dtype=bool)
        if len(self._sorted):
            at = np.minimum(np.searchsorted(self._sorted, hashes), len(self._sorted) - 1)
            held = self._sorted[at] == hashes
        return [
            eid
            for eid, h, found in zip(eids, hashes.tolist(), held.tolist(), strict=True)
            if found or h in self._recent
        ]

    def _merge(self) -> None:
        if not self._recent:
            return
        new = np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))
        new.sort()
        if len(self._sorted):
            at = np.minimum(np.searchsorted(self._sorted, new), len(self._sorted) - 1)
            new = new[self._sorted[at] != new]
        self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, new), new)
        self._recent.clear()
