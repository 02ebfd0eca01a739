"""Sampling a command and everything it starts while it runs: the base of the benchmarks'
memory and CPU samplers."""

from __future__ import annotations

import threading
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
    taken once `until()` held (finding the processes costs several ms of CPU a sample, which
    the command measured would otherwise pay for)."""

    def __init__(
        self,
        extra: Callable[[], list[psutil.Process]] = list,
        interval_s: float = 1.0,
        until: Callable[[], bool] = lambda: False,
    ) -> None:
        self._extra = extra
        self._interval_s = interval_s
        self._until = until
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
        while True:
            last = self._until()
            try:
                children = me.children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            found = {p.pid: p for p in [me, *children, *self._extra()]}
            self.take(list(found.values()))
            if last or self._stop.wait(self._interval_s):
                return
