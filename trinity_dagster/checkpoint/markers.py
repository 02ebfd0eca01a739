"""`CheckpointMonitor`: moves the `latest_*` pointer files only when a step's saves all finished.

As in Trinity-RFT, a save of step N may run on several background threads (the full state,
and the weights that serve as the sync); each registers, starts and finishes with the
monitor. `latest_checkpointed_iteration.txt` moves to N once every checkpoint thread of N
finished, `latest_state_dict_iteration.txt` once every state-dict thread did, and neither
ever moves backwards. Thread-safe; no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from trinity_dagster.checkpoint.layout import latest_checkpoint_step, set_latest_checkpoint_step
from trinity_dagster.checkpoint.publish import advance_weights_marker
from trinity_dagster.paths import RunPaths


@dataclass
class _Threads:
    expected: int = 0
    started: int = 0
    finished: int = 0

    @property
    def done(self) -> bool:
        return self.finished >= self.expected


class CheckpointMonitor:
    """Tracks the save threads of each step and moves the pointer files when they are done.

    `on_complete(step, is_state_dict)` is called (outside the lock) after a pointer moved.
    """

    def __init__(
        self,
        paths: RunPaths,
        on_complete: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.paths = paths
        self.on_complete = on_complete
        self._lock = threading.Condition()
        self._threads: dict[tuple[int, bool], _Threads] = {}

    def register_thread_count(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """Declare how many threads will save the state dict and the checkpoint of `step`."""
        if state_dict_thread_count < 0 or checkpoint_thread_count < 0:
            raise ValueError("thread counts must be >= 0")
        with self._lock:
            for is_state_dict, count in (
                (True, state_dict_thread_count),
                (False, checkpoint_thread_count),
            ):
                if count:
                    self._threads[(step, is_state_dict)] = _Threads(expected=count)

    def monitor_step(
        self, step: int, is_state_dict: bool = False, timeout: float | None = None
    ) -> bool:
        """Wait until every registered thread of `step` finished (or none is registered).

        Returns False on timeout.
        """
        with self._lock:
            return self._lock.wait_for(
                lambda: (step, is_state_dict) not in self._threads, timeout=timeout
            )

    def notify_started(self, step: int, is_state_dict: bool = False) -> None:
        """A save thread of `step` started."""
        with self._lock:
            self._entry(step, is_state_dict).started += 1

    def notify_finished(self, step: int, is_state_dict: bool = False) -> None:
        """A save thread of `step` finished; the pointer moves if it was the last one."""
        with self._lock:
            entry = self._entry(step, is_state_dict)
            if entry.finished >= entry.expected:
                raise ValueError(
                    f"step {step}: more {'state-dict' if is_state_dict else 'checkpoint'} save "
                    f"threads finished than the {entry.expected} registered"
                )
            entry.finished += 1
            complete = entry.done
            if complete:
                del self._threads[(step, is_state_dict)]
                if is_state_dict:
                    self.update_latest_state_dict_step(step)
                else:
                    self.update_latest_checkpoint_step(step)
            self._lock.notify_all()
        if complete and self.on_complete is not None:
            self.on_complete(step, is_state_dict)

    def update_latest_checkpoint_step(self, step: int) -> None:
        """Move `latest_checkpointed_iteration.txt` forward to `step` (never backwards)."""
        current = _marker_or_none(latest_checkpoint_step, self.paths)
        if current is None or step > current:
            set_latest_checkpoint_step(self.paths, step)

    def update_latest_state_dict_step(self, step: int) -> None:
        """Move `latest_state_dict_iteration.txt` forward to `step` (never backwards)."""
        advance_weights_marker(self.paths, step)

    def pending_steps(self) -> list[int]:
        """Steps with registered threads that have not all finished, ascending."""
        with self._lock:
            return sorted({step for step, _ in self._threads})

    def _entry(self, step: int, is_state_dict: bool) -> _Threads:
        entry = self._threads.get((step, is_state_dict))
        if entry is None:
            kind = "state-dict" if is_state_dict else "checkpoint"
            raise KeyError(f"no {kind} save threads of step {step} are registered")
        return entry


def _marker_or_none(read: Callable[[RunPaths], int | None], paths: RunPaths) -> int | None:
    """The marker's step; a damaged marker counts as none (it is rewritten)."""
    try:
        return read(paths)
    except ValueError:
        return None
