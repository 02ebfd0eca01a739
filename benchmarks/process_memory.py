"""The peak memory of a command and everything it starts, sampled while it runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

import psutil


def total_pss(processes: list[psutil.Process]) -> int:
    """The summed proportional set size (bytes) of `processes`; those gone are skipped.

    PSS splits each shared page between the processes mapping it, so the sum counts shared
    libraries and torch's memory once, where a sum of RSS counts them once per process.
    """
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total


class PeakPss:
    """Within: samples the PSS of this process, its descendants and `extra()` every
    `interval_s`; `peak_mb` is the largest sum seen."""

    def __init__(
        self,
        extra: Callable[[], list[psutil.Process]] = list,
        interval_s: float = 0.5,
    ) -> None:
        self._extra = extra
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.peak_mb = 0.0

    def __enter__(self) -> PeakPss:
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

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            found = {p.pid: p for p in [me, *me.children(recursive=True), *self._extra()]}
            self.peak_mb = max(self.peak_mb, total_pss(list(found.values())) / 2**20)
            self._stop.wait(self._interval_s)
