"""The CPU time of a command and everything it starts, sampled while it runs."""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType

import psutil

from benchmarks.process_memory import process_label


class CpuTimeline:
    """Within: samples the CPU seconds (user + system, all threads) each process has used so
    far, for this process, its descendants and `extra()`, every `interval_s`; afterwards
    `used_between` gives each process's CPU seconds between two wall-clock times.

    A process that ended keeps its last sample. Sampling reads each process's `stat` file:
    about 0.1 ms a process, well under 1% of a core at the default interval.
    """

    def __init__(
        self,
        extra: Callable[[], list[psutil.Process]] = list,
        interval_s: float = 0.1,
    ) -> None:
        self._extra = extra
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._times: list[float] = []
        self._totals: list[dict[int, float]] = []
        self.labels: dict[int, str] = {}

    def __enter__(self) -> CpuTimeline:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def used_between(self, start: float, end: float) -> dict[int, float]:
        """CPU seconds of each sampled process (by pid) between wall-clock (`time.time()`)
        `start` and `end`, from the samples nearest before each (none before: zero)."""
        before, after = self._at(start), self._at(end)
        return {pid: total - before.get(pid, 0.0) for pid, total in after.items()}

    def _at(self, when: float) -> Mapping[int, float]:
        index = bisect.bisect_right(self._times, when) - 1
        return self._totals[index] if index >= 0 else {}

    def _sample(self) -> None:
        me = psutil.Process()
        known: dict[int, psutil.Process] = {}
        last: dict[int, float] = {}
        while True:
            for process in [me, *_children(me), *self._extra()]:
                if process.pid not in known:
                    known[process.pid] = process
                    self.labels[process.pid] = _label_of(process)
            for pid, process in list(known.items()):
                try:
                    used = process.cpu_times()
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    del known[pid]  # ended: its last sample stays
                    continue
                last[pid] = used.user + used.system
            self._times.append(time.time())
            self._totals.append(dict(last))
            if self._stop.wait(self._interval_s):
                return


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _label_of(process: psutil.Process) -> str:
    if process.pid == os.getpid():
        return "this process"
    try:
        return process_label(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return "?"
