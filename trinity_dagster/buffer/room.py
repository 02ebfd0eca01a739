"""Room in the experience buffer under `buffer.capacity`, for an explorer about to write.

Unconsumed experiences are those written and not yet resolved (trained on as often as the
sampler allows, or dropped): `stats.unconsumed_count`. Counting them opens both tables once
(about 15 ms for a buffer of 40 steps), so a `BufferRoom` counts again only after a commit to
either table it has not accounted for; its own writes it adds itself.
"""

from __future__ import annotations

import time

from trinity_dagster.buffer.stats import unconsumed_count
from trinity_dagster.buffer.tables import has_commit_after, open_table
from trinity_dagster.buffer.writer import WriteReport
from trinity_dagster.config import TrinityConfig
from trinity_dagster.handoff.wakeup import EXPLORER, Wakeup
from trinity_dagster.paths import RunPaths


class BufferRoom:
    """Whether more experiences fit under `buffer.capacity` (always, without one)."""

    def __init__(self, config: TrinityConfig) -> None:
        self._capacity = config.buffer.capacity
        self._config = config
        paths = RunPaths.of_config(config)
        self._experiences, self._batches = paths.experiences, paths.batches
        self._wakeup_dir = paths.wakeup
        # the versions of (experiences, batches) the count is of; None: not counted yet
        self._counted_at: tuple[int | None, int | None] | None = None
        self._unconsumed = 0

    def fits(self, rows: int) -> bool:
        """Whether `rows` more experiences keep the unconsumed ones within the capacity."""
        if self._capacity is None:
            return True
        return self.unconsumed + rows <= self._capacity

    def wait(self, rows: int, timeout_s: float) -> None:
        """Return once `rows` more experiences fit, woken by the trainer's pins: for an
        explorer of its own that writes with `ExperienceWriter`. Raises `TimeoutError` after
        `timeout_s`, and `ValueError` for more rows than the capacity holds."""
        capacity = self._capacity
        if capacity is not None and rows > capacity:
            raise ValueError(f"{rows} experiences never fit in buffer.capacity {capacity}")
        if self.fits(rows):
            return
        deadline = time.monotonic() + timeout_s
        wakeup = Wakeup(self._wakeup_dir, EXPLORER, "room")
        try:
            while not self.fits(rows):  # looked at again once listening: no pin is missed
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no room for {rows} experiences within {timeout_s:g} s: "
                        f"{self.unconsumed} unconsumed, buffer.capacity {capacity}"
                    )
                wakeup.wait(min(left, wakeup.poll_s))
        finally:
            wakeup.close()

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
            if self._counted_at is None:
                versions = (_version(self._experiences), _version(self._batches))
            else:
                experiences, batches = self._counted_at
                versions = (
                    _newest(self._experiences, experiences),
                    _newest(self._batches, batches),
                )
            self._counted_at = versions
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


def _newest(location: str, known: int | None) -> int | None:
    """The latest version of the Delta table at `location`, found from version `known` (None:
    no table then) with a `stat` per newer commit instead of opening the table."""
    version = -1 if known is None else known
    while has_commit_after(location, version):
        version += 1
    return None if version < 0 else version
