"""Pinning the next step's batch while the current step trains.

When explorers run ahead of training (`sync_offset` > 0, a `sync_interval` over 1, the
asynchronous sync styles), the rows of step N+1 are committed while step N trains. The
trainer then pins step N+1 on a worker thread as soon as they are there, so that the pin's
Delta commit is off its critical path. A pin made ahead is an ordinary pin: if training stops
before step N+1 (a pause, a crash), the next run trains step N+1 from it, as it does with a
pin whose step was interrupted.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trinity_dagster.buffer.sampler import BatchPinner, PinResult
from trinity_dagster.buffer.tables import has_commit_after
from trinity_dagster.handoff.wakeup import TRAINER, Wakeup

log = logging.getLogger(__name__)


class PinAhead:
    """One pin at a time on a worker thread, for the loop that owns `pinner`.

    The owner calls `pinner` itself only after `take`, which waits for the worker, so the two
    never use it at once. The worker looks for new experiences (one `stat`) when an explorer's
    commit wakes it (`handoff/wakeup.py`, under `wakeup_dir`) and at the wake-up's poll.
    """

    def __init__(self, pinner: BatchPinner, experiences: str | Path, wakeup_dir: Path) -> None:
        self._pinner = pinner
        self._experiences = experiences
        self._wakeup_dir = wakeup_dir
        self._wakeup: Wakeup | None = None  # listening from the first `start` to `close`
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pin-ahead")
        self._taken = threading.Event()
        self._pending: tuple[int, Future[PinResult | None]] | None = None

    def start(self, step: int, seen_version: int) -> None:
        """Pin `step` in the background once the experiences table has commits newer than
        `seen_version` (the version the previous pin read) that make up its batch, until
        `take` is called."""
        self.take(None)  # never two at once
        self._taken.clear()
        if self._wakeup is None:
            self._wakeup = Wakeup(self._wakeup_dir, TRAINER, "pin-ahead")
        wakeup = self._wakeup
        self._pending = (
            step,
            self._pool.submit(self._pin_when_there, step, seen_version, wakeup),
        )

    def take(self, step: int | None) -> PinResult | None:
        """Stop looking, wait for a pin under way; its batch if it pinned `step`, else None
        (none was started, it was of another step, the rows were not there yet, or it failed:
        the caller's own pin then tries again and raises what persists)."""
        if self._pending is None:
            return None
        self._taken.set()
        if self._wakeup is not None:
            self._wakeup.interrupt()  # the worker's wait ends now, not at its next poll
        pinned_step, future = self._pending
        self._pending = None
        try:
            result = future.result()
        except Exception as err:  # the caller's own pin meets it again
            log.warning("pin of step %d ahead of training failed: %s", pinned_step, err)
            return None
        return result if pinned_step == step else None

    def close(self) -> None:
        """Wait for a pin under way and stop the worker thread."""
        self.take(None)
        self._pool.shutdown()
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None

    def _pin_when_there(self, step: int, seen: int | None, wakeup: Wakeup) -> PinResult | None:
        """Pin `step` as soon as enough rows are committed; None if `take` came first."""
        while not self._taken.is_set():
            if has_commit_after(self._experiences, seen):
                result = self._pinner.pin(step)
                if isinstance(result, PinResult):
                    return result
                seen = result.source_version
            wakeup.wait()
        return None
