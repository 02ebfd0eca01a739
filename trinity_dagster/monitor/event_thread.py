"""Logging from one thread beside the loop that produces what is logged.

A step's Dagster events cost the trainer loop a few milliseconds of SQLite writes (five per
step), and its metrics a flush of each tracking backend's files; the loop hands them to an
`EventThread` and goes on to its next step. They are logged in the order handed over. A
failure to log is raised to the producer at its next hand-over or at `flush`, so a run whose
events or metrics cannot be stored still fails with the cause.
"""

import queue
import threading
from collections.abc import Callable

_STOP = None


class EventThread:
    """Runs the callables handed to it, one at a time, in order, on one daemon thread."""

    def __init__(self, name: str, what: str = "logging a Dagster event") -> None:
        self._name = name
        self._what = what  # what the callables do, for the error raised to the producer
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, log: Callable[[], None]) -> None:
        """Run `log` after those submitted before; raises the error of an earlier one."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(log)

    def flush(self) -> None:
        """Wait until everything submitted ran; raises the first error among them."""
        if self._thread is not None:
            self._queue.join()
        self._raise_error()

    def close(self) -> None:
        """`flush`, then end the thread (a later `submit` starts a new one)."""
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self._what} failed: {error}") from error

    def _work(self) -> None:
        while (log := self._queue.get()) is not _STOP:
            try:
                if self._error is None:  # after a failure the rest is dropped, not reordered
                    log()
            except BaseException as err:  # handed to the producer
                self._error = err
            finally:
                self._queue.task_done()
        self._queue.task_done()
