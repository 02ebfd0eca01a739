"""The peak memory of a command and everything it starts, sampled while it runs."""

from __future__ import annotations

from collections.abc import Callable

import psutil

from benchmarks.process_sampler import ProcessSampler, process_label


def pss_by_process(processes: list[psutil.Process]) -> dict[str, float]:
    """The proportional set size (MB) of each of `processes` by a short label of its command
    line; those gone are skipped.

    PSS splits each shared page between the processes mapping it, so a sum counts shared
    libraries and torch's memory once, where a sum of RSS counts them once per process.
    """
    found: dict[str, float] = {}
    for process in processes:
        try:
            pss = process.memory_full_info().pss / 2**20
            label = f"{process.pid} {process_label(process.cmdline())}"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found[label] = round(pss, 1)
    return found


class PeakPss(ProcessSampler):
    """Within: samples the PSS of this process, its descendants and `extra()` every
    `interval_s`; `peak_mb` is the largest sum seen and `at_peak` its parts by process.

    A sample reads each process's smaps (measured ~6 ms for a process holding torch, so
    ~60 ms for a training run's processes): every 2 s that is ~3% of a core beside what is
    measured.
    """

    def __init__(
        self, extra: Callable[[], list[psutil.Process]] = list, interval_s: float = 2.0
    ) -> None:
        super().__init__(extra, interval_s)
        self.peak_mb = 0.0
        self.at_peak: dict[str, float] = {}

    def take(self, processes: list[psutil.Process]) -> None:
        parts = pss_by_process(processes)
        total = sum(parts.values())
        if total > self.peak_mb:
            self.peak_mb, self.at_peak = total, parts
