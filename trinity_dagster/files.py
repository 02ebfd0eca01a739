"""Crash-safe file writes, the one way this project replaces a file.

A file is written to a hidden temp file beside it, fsynced, renamed over the target, and the
directory is fsynced: a reader (or a restart after a power cut) sees the old file or the new
one, never a part of either. A file of a private directory that becomes visible only when
renamed into place, whole, needs none of that: `write_file_synced` writes it where it goes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

FILE_MODE = 0o644
PRIVATE_MODE = 0o600


def write_file_atomic(
    path: Path, write: Callable[[Path], object], *, mode: int = FILE_MODE
) -> None:
    """Replace `path` with the file `write` writes at the temp path it is given.

    The temp file has `mode` before `write` runs (so a secret is never readable by others);
    on any error it is removed and `path` is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    os.close(fd)
    try:
        tmp.chmod(mode)
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


def write_text_atomic(path: Path, text: str, *, mode: int = FILE_MODE) -> None:
    """Replace `path` with `text` (see `write_file_atomic`)."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text), mode=mode)


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
