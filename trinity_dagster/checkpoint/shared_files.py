"""The small files every published weights version repeats, stored once and hard-linked.

A published version's `config.json`, tokenizer files and generation config are the same from
one version to the next. `SharedFiles` keeps each content once, fsynced, under its sha256 in
a directory of the run (`weights/shared/`), and gives a version directory a hard link to it:
the link needs no write and no fsync of its own, only the fsync of the directory that holds
it, which the publish makes anyway. Where the file system refuses hard links the file is
written and fsynced as before.

A stored file is compared with the content it should hold the first time a process links it,
so a damaged or altered one is replaced instead of spreading into new versions.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from trinity_dagster.files import write_file_atomic, write_file_synced

# what a file system answers when it has no hard links, or none more for a file
_NO_HARD_LINK = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK)
# stored files this process has checked against their name (their content's sha256)
_checked: set[Path] = set()
# the content's sha256 of each source file read, by path, size, modification time and inode
_digests: dict[tuple[str, int, int, int], str] = {}


class SharedFiles:
    """Files stored by content in `directory`, placed into new directories as hard links."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def place(self, target: Path, data: bytes) -> None:
        """Create the new file `target` holding `data`: a hard link to the stored copy of
        `data`, or, where no hard link can be made, a file written and fsynced in place.

        The caller fsyncs `target`'s directory. Raises FileExistsError if `target` exists.
        """
        self._place(target, hashlib.sha256(data).hexdigest(), lambda: data)

    def place_copy(self, target: Path, source: Path) -> None:
        """`place(target, source.read_bytes())`, reading `source` again only once it changed."""
        info = source.stat()
        key = (str(source), info.st_size, info.st_mtime_ns, info.st_ino)
        digest = _digests.get(key)
        if digest is None:
            data = source.read_bytes()
            digest = _digests[key] = hashlib.sha256(data).hexdigest()
            self._place(target, digest, lambda: data)
        else:
            self._place(target, digest, source.read_bytes)

    def _place(self, target: Path, digest: str, data: Callable[[], bytes]) -> None:
        """Link `target` to the stored copy named `digest`, stored from `data()` unless this
        process checked it already."""
        stored = self.directory / digest
        try:
            try:
                os.link(stored if stored in _checked else self._store(data()), target)
            except FileNotFoundError:  # a stored copy removed since this process checked it
                _checked.discard(stored)
                os.link(self._store(data()), target)
        except OSError as err:
            if err.errno not in _NO_HARD_LINK:
                raise
            content = data()
            write_file_synced(target, lambda path: path.write_bytes(content))

    def _store(self, content: bytes) -> Path:
        """The stored copy of `content` (named by its sha256), written and fsynced unless the
        one there is whole."""
        stored = self.directory / hashlib.sha256(content).hexdigest()
        try:
            whole = stored.read_bytes() == content
        except FileNotFoundError:
            whole = False
        if not whole:
            write_file_atomic(stored, lambda path: path.write_bytes(content))
        _checked.add(stored)
        return stored
