"""Crash-safe file writes, the one way this project replaces a file.

A file is written to a hidden temp file beside it, fsynced, renamed over the target, and the
directory is fsynced: a reader (or a restart after a power cut) sees the old file or the new
one, never a part of either. A file of a private directory that becomes visible only when
renamed into place, whole, needs none of that: `write_file_synced` writes it where it goes.

Without the fsyncs (`fsync=False`) the rename still keeps a reader, and a restart after a
killed process, from ever seeing part of a file; only a power cut can lose it. That is for
files that mean nothing after a reboot (a live reader's hold), or whose flush a
`BackgroundFsync` does off the caller's path.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

FILE_MODE = 0o644
PRIVATE_MODE = 0o600


def write_file_atomic(
    path: Path, write: Callable[[Path], object], *, mode: int = FILE_MODE, fsync: bool = True
) -> None:
    """Replace `path` with the file `write` writes at the temp path it is given.

    The temp file has `mode` before `write` runs (so a secret is never readable by others);
    on any error it is removed and `path` is left as it was. `fsync=False`: neither the file
    nor the directory is flushed (see the module docstring).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    os.close(fd)
    try:
        tmp.chmod(mode)
        write(tmp)
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def write_file_synced(
    path: Path, write: Callable[[Path], object], *, mode: int = FILE_MODE
) -> None:
    """Create the new file `path`, have `write` fill it, give it `mode` and fsync it.

    For files of a directory that no reader sees before it is complete (renamed into place):
    the caller fsyncs that directory once. Raises FileExistsError if `path` exists.
    """
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))
    write(path)
    os.chmod(path, mode)  # whatever the umask, and if `write` made the file anew
    _fsync(path)


def write_text_atomic(path: Path, text: str, *, mode: int = FILE_MODE, fsync: bool = True) -> None:
    """Replace `path` with `text` (see `write_file_atomic`)."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text), mode=mode, fsync=fsync)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    _fsync(path)


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackgroundFsync:
    """Flushes files and directories to disk on a thread of its own, in the order given.

    For a writer whose files must reach the disk soon, but not before it goes on (a step's
    record, flushed while the next step trains). A failed flush is raised by the next `add`,
    `wait` or `close`.
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: list[Future[None]] = []

    def add(self, *paths: Path) -> None:
        """Flush `paths` (files or directories) after everything added before them."""
        self._raise_failed()
        self._pending.extend(self._pool.submit(_fsync, path) for path in paths)

    def wait(self) -> None:
        """Return once everything added is on disk; raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """`wait`, then stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown()

    def _raise_failed(self) -> None:
        done: list[Future[None]] = []
        running: list[Future[None]] = []
        for future in self._pending:
            (done if future.done() else running).append(future)
        self._pending = running
        for future in done:
            future.result()
