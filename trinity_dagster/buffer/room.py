"""Room in the experience buffer under `buffer.capacity`, for an explorer about to write.

Unconsumed experiences are those written and not yet resolved (trained on as often as the
sampler allows, or dropped): `stats.unconsumed_count`. Counting them opens both tables (tens
of milliseconds), so a `BufferRoom` counts again only after a commit to either table it has
not accounted for; its own writes it adds itself.
"""

from __future__ import annotations

from trinity_dagster.buffer.stats import unconsumed_count
from trinity_dagster.buffer.tables import has_commit_after, open_table
from trinity_dagster.buffer.writer import WriteReport
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths


class BufferRoom:
    """Whether more experiences fit under `buffer.capacity` (always, without one)."""

    def __init__(self, config: TrinityConfig) -> None:
        self._capacity = config.buffer.capacity
        self._config = config
        paths = RunPaths.of_config(config)
        self._experiences, self._batches = paths.experiences, paths.batches
        # the versions of (experiences, batches) the count is of; None: not counted yet
        self._counted_at: tuple[int | None, int | None] | None = None
        self._unconsumed = 0

    def fits(self, rows: int) -> bool:
        """Whether `rows` more experiences keep the unconsumed ones within the capacity."""
        if self._capacity is None:
            return True
        return self.unconsumed + rows <= self._capacity

    def wrote(self, report: WriteReport) -> None:
        """Account for this explorer's own write, so that it needs no count of its own."""
        if self._counted_at is None or report.version is None:
            return
        experiences, batches = self._counted_at
        if report.version == (-1 if experiences is None else experiences) + 1:
            self._counted_at = (report.version, batches)
            self._unconsumed += report.written

    @property
    def unconsumed(self) -> int:
        """The unconsumed experiences now: counted again if a commit came since the count
        that this explorer's own writes do not account for."""
        if self._stale():
            # the versions first: a commit landing during the count makes the next call count again
            self._counted_at = (_version(self._experiences), _version(self._batches))
            self._unconsumed = unconsumed_count(self._config)
        return self._unconsumed

    def _stale(self) -> bool:
        if self._counted_at is None:
            return True
        experiences, batches = self._counted_at
        return has_commit_after(self._experiences, experiences) or has_commit_after(
            self._batches, batches
        )


def _version(location: str) -> int | None:
    """The latest version of the Delta table at `location` (None: no table yet)."""
    table = open_table(location)
    return None if table is None else table.version()
