"""Sampling a command and everything it starts while it runs: the base of the benchmarks'
memory and CPU samplers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

import psutil


def process_label(cmdline: list[str]) -> str:
    """The program and its first arguments, paths shortened to their last part."""
    words = [word.rsplit("/", 1)[-1] for word in cmdline[:6] if not word.startswith("--")]
    return " ".join(words)[:90]


class ProcessSampler:
    """Within: calls `take` every `interval_s` on a thread, with this process, its
    descendants and `extra()` (each once), until the block ends, or until the first sample
    taken once `until()` held. The processes are found (a scan of every process on the
    machine, about 5 ms of CPU) for the first sample, for the one taken once `until()` held,
    and every `list_every_s` (default: every sample); the samples in between take those last
    found."""

    def __init__(
        self,
        extra: Callable[[], list[psutil.Process]] = list,
        interval_s: float = 1.0,
        until: Callable[[], bool] = lambda: False,
        list_every_s: float | None = None,
    ) -> None:
        self._extra = extra
        self._interval_s = interval_s
        self._until = until
        self._list_every_s = interval_s if list_every_s is None else list_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Self:
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

    def take(self, processes: list[psutil.Process]) -> None:
        """One sample of `processes` (some may have ended since they were listed)."""
        raise NotImplementedError

    def _sample(self) -> None:
        me = psutil.Process()
        found: list[psutil.Process] = []
        listed_at = -self._list_every_s
        while True:
            last = self._until()
            if last or time.monotonic() - listed_at >= self._list_every_s:
                listed_at = time.monotonic()
                try:
                    children = me.children(recursive=True)
                except psutil.NoSuchProcess:
                    children = []
                found = list({p.pid: p for p in [me, *children, *self._extra()]}.values())
            self.take(found)
            if last or self._stop.wait(self._interval_s):
                return
