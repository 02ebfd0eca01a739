"""Waking a waiting loop as soon as what it waits for has landed, rather than at its next poll.

The trainer loop waits for new experiences (and, while a step trains, its pin-ahead thread
for the next step's), the explorer loop for new weights. Each waiting side binds a Unix
datagram socket under `logs/wakeup/` and sleeps on it between polls (`Wakeup.wait`); the side
that makes the thing land (the explorer once it committed rows; the engine once it moved the
weights marker, and the trainer after a sync) sends one byte to every socket of the waiting
side (`wake`). A wake-up is only a hint: the waiter still checks what it waits for and still
polls, so a lost wake-up or a waiter that died costs at most one poll interval, never a
missed hand-off.

A waiter that listens polls every `LISTENING_POLL_S` (50 ms): the wake-up is its fast path.
Polling every 5 ms as well woke the explorer and the pin-ahead thread about 25 times during
each train step; on two cores each wake-up took a core from one of the engine's two torch
threads, and the step waited for it (docs/performance.md). A waiter that cannot listen (a
socket path too long for Unix sockets, about 100 bytes) polls every `POLL_S` (5 ms).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from pathlib import Path

TRAINER = "trainer"
EXPLORER = "explorer"
# longest path a Unix socket address holds on Linux (108 bytes with the terminating NUL)
_MAX_SOCKET_PATH = 107
POLL_S = 0.005  # between polls of a waiter that cannot listen
LISTENING_POLL_S = 0.05  # between polls of one that listens: what a lost wake-up costs


class Wakeup:
    """A waiting side's socket: `wait` returns at a wake-up or after the timeout."""

    def __init__(self, directory: Path, side: str, name: str) -> None:
        self.path = directory / f"{side}.{name}.{os.getpid()}.sock"
        self._socket: socket.socket | None = None
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            return  # polls alone
        directory.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.path.unlink(missing_ok=True)
            sock.bind(str(self.path))
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        self._socket = sock

    @property
    def poll_s(self) -> float:
        """How long `wait` sleeps unless woken: `LISTENING_POLL_S`, or `POLL_S` for a waiter
        that cannot listen."""
        return POLL_S if self._socket is None else LISTENING_POLL_S

    def wait(self, timeout_s: float | None = None) -> None:
        """Sleep up to `timeout_s` (None: `poll_s`), less if woken (wake-ups sent meanwhile
        are consumed)."""
        timeout_s = self.poll_s if timeout_s is None else timeout_s
        if self._socket is None:
            time.sleep(timeout_s)
            return
        readable, _, _ = select.select([self._socket], [], [], timeout_s)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self._socket.recv(16)

    def interrupt(self) -> None:
        """End a `wait` of this waiter (from another thread) as a wake-up would."""
        if self._socket is not None:
            with _sender() as sock:
                _send(sock, self.path)

    def close(self) -> None:
        """Stop listening and remove the socket file."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            self.path.unlink(missing_ok=True)


def wake(directory: Path, side: str) -> None:
    """Wake every waiter of `side` (`TRAINER`, `EXPLORER`) listening under `directory`;
    sockets of waiters that are gone are removed."""
    try:
        paths = list(directory.glob(f"{side}.*.sock"))
    except OSError:
        return
    if not paths:
        return
    with _sender() as sock:
        for path in paths:
            _send(sock, path)


def _sender() -> socket.socket:
    """A non-blocking datagram socket to send wake-ups from."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock


def _send(sock: socket.socket, path: Path) -> None:
    """One byte to the socket at `path`; removed if no one listens there (its waiter died)."""
    try:
        sock.sendto(b"!", str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)
    except OSError:  # a full queue is awake anyway; a vanished file is gone
        pass
