"""Waking a waiting loop as soon as what it waits for has landed, rather than at its next poll.

The trainer loop polls for new experiences and the explorer loop for new weights, every 5 ms
(2.5 ms of latency each on average, on each side of every step). Each waiting side binds a
Unix datagram socket under `logs/wakeup/` and sleeps on it between polls (`Wakeup.wait`);
the side that makes the thing land (the explorer once it committed rows; the engine once it
moved the weights marker, and the trainer after a sync) sends one byte to every socket of the
waiting side (`wake`). A wake-up is only a hint: the waiter still checks what it waits for
and still polls, so a lost wake-up, a socket path too long for Unix sockets (about 100 bytes)
or a waiter that died costs at most one poll interval, never a missed hand-off.
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

    def wait(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, less if woken (wake-ups sent meanwhile are consumed)."""
        if self._socket is None:
            time.sleep(timeout_s)
            return
        readable, _, _ = select.select([self._socket], [], [], timeout_s)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self._socket.recv(16)

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
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for path in paths:
            try:
                sock.sendto(b"!", str(path))
            except ConnectionRefusedError:  # no one listens: its waiter died
                path.unlink(missing_ok=True)
            except OSError:  # a full queue is awake anyway; a vanished file is gone
                pass
