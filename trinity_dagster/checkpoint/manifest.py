"""`manifest.json`: the last file of a checkpoint, listing every other file with size and sha256.

A checkpoint directory without a valid manifest is incomplete by definition. The manifest also
holds the step, the configuration hash and the sampler cursor, so the data position and the
weights of a checkpoint can never disagree, and whether its HF export is the sync of its step
(written once, read by whoever records the sync).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trinity_dagster.checkpoint.layout import MANIFEST_FILE
from trinity_dagster.files import fsync_dir, write_text_atomic

MANIFEST_VERSION = 1
_CHUNK = 4 << 20
_STEP_DIR = re.compile(r"global_step_(\d+)")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or damaged; the message names the file and the fault."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint directory, size, sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The contents of `manifest.json`."""

    step: int
    config_hash: str
    sampler_state: dict[str, Any]
    files: tuple[FileEntry, ...]
    serves_as_sync: bool = False  # its `huggingface/` export is the sync of its step
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    complete: bool = True
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(
            {
                "version": self.version,
                "step": self.step,
                "config_hash": self.config_hash,
                "created_at": self.created_at,
                "sampler_state": self.sampler_state,
                "serves_as_sync": self.serves_as_sync,
                "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
                "complete": self.complete,
            },
            indent=1,
            sort_keys=True,
        )

    def digest(self) -> str:
        """sha256 of the manifest's JSON text: one fingerprint of the whole checkpoint."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        """Parse manifest JSON read from `source`; any fault raises CorruptCheckpointError."""
        try:
            data = json.loads(text)
            manifest = cls(
                step=_typed(data, "step", int),
                config_hash=_typed(data, "config_hash", str),
                sampler_state=_typed(data, "sampler_state", dict),
                files=tuple(
                    FileEntry(
                        path=_typed(item, "path", str),
                        size=_typed(item, "size", int),
                        sha256=_typed(item, "sha256", str),
                    )
                    for item in _typed(data, "files", list)
                ),
                serves_as_sync=_typed(data, "serves_as_sync", bool)
                if "serves_as_sync" in data
                else False,
                created_at=_typed(data, "created_at", str),
                complete=_typed(data, "complete", bool),
                version=_typed(data, "version", int),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise CorruptCheckpointError(f"{source}: bad manifest JSON: {err}") from None
        if not manifest.files:
            raise CorruptCheckpointError(f"{source}: manifest lists no files")
        if manifest.version != MANIFEST_VERSION:
            raise CorruptCheckpointError(
                f"{source}: manifest version {manifest.version} is not {MANIFEST_VERSION}"
            )
        for entry in manifest.files:
            parts = Path(entry.path).parts
            if Path(entry.path).is_absolute() or ".." in parts or not parts:
                raise CorruptCheckpointError(
                    f"{source}: file path {entry.path!r} is not inside the checkpoint"
                )
        if not manifest.complete:
            raise CorruptCheckpointError(f"{source}: manifest says the checkpoint is incomplete")
        return manifest


def _typed(data: Any, key: str, kind: type) -> Any:
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """The sha256 of a file, read in 4 MiB chunks; `fsync` also flushes it to disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def build_manifest(
    ckpt_dir: Path,
    *,
    step: int,
    config_hash: str,
    sampler_state: dict[str, Any],
    serves_as_sync: bool = False,
) -> Manifest:
    """List, hash and fsync every file under `ckpt_dir` (except a manifest) into a Manifest.

    `serves_as_sync` records that the checkpoint's HF export is the sync of its step.
    """
    try:
        json.dumps(sampler_state)
    except (TypeError, ValueError) as err:
        raise ValueError(f"sampler_state of step {step} is not JSON-serializable: {err}") from None
    entries = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames):
            file = base / name
            rel = file.relative_to(ckpt_dir).as_posix()
            if rel == MANIFEST_FILE:
                continue
            if file.is_symlink() or not file.is_file():
                raise ValueError(f"{file}: checkpoint files must be regular files")
            digest = sha256_file(file, fsync=True)
            entries.append(FileEntry(rel, file.stat().st_size, digest))
        fsync_dir(base)
    if not entries:
        raise ValueError(f"{ckpt_dir}: no files to put in a manifest")
    return Manifest(
        step=step,
        config_hash=config_hash,
        sampler_state=dict(sampler_state),
        files=tuple(entries),
        serves_as_sync=serves_as_sync,
    )


def write_manifest(ckpt_dir: Path, manifest: Manifest) -> Path:
    """Write `manifest.json` into `ckpt_dir` atomically (temp file, fsync, rename)."""
    path = ckpt_dir / MANIFEST_FILE
    write_text_atomic(path, manifest.to_json())
    return path


def read_manifest(ckpt_dir: Path) -> Manifest:
    """The manifest of `ckpt_dir`, parsed but without checking the files it lists."""
    path = ckpt_dir / MANIFEST_FILE
    if not ckpt_dir.is_dir():
        raise CorruptCheckpointError(f"{ckpt_dir}: checkpoint directory is missing")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: no manifest (the checkpoint is incomplete)"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path}: unreadable manifest: {err}") from None
    manifest = Manifest.from_json(text, path)
    match = _STEP_DIR.fullmatch(ckpt_dir.name)
    if match and int(match.group(1)) != manifest.step:
        raise CorruptCheckpointError(
            f"{path}: manifest is for step {manifest.step}, the directory for step {match.group(1)}"
        )
    return manifest


def verify_checkpoint(ckpt_dir: Path, *, checksums: bool = True) -> Manifest:
    """Check every file the manifest lists (presence, size and, if `checksums`, sha256).

    Every listed file must be a regular file reached without symlinks. Returns the manifest;
    raises CorruptCheckpointError naming the first bad file.
    """
    manifest = read_manifest(ckpt_dir)
    root = Path(os.path.realpath(ckpt_dir))
    for entry in manifest.files:
        _verify_file(ckpt_dir / entry.path, root, entry, checksums=checksums)
    return manifest


def _verify_file(file: Path, root: Path, entry: FileEntry, *, checksums: bool) -> None:
    """Raise CorruptCheckpointError unless `file` is a regular file under `root` as `entry` says."""
    try:
        info = file.lstat()
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptCheckpointError(f"{file}: missing (listed in the manifest)") from None
    resolved = Path(os.path.realpath(file))
    if resolved != root / entry.path:
        where = "inside" if resolved.is_relative_to(root) else "outside"
        raise CorruptCheckpointError(
            f"{file}: is or passes through a symlink to {resolved} ({where} the checkpoint); "
            "checkpoint files must be regular files"
        )
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpointError(f"{file}: not a regular file (listed in the manifest)")
    if info.st_size != entry.size:
        raise CorruptCheckpointError(
            f"{file}: size {info.st_size} bytes, the manifest says {entry.size}"
        )
    if checksums:
        digest = sha256_file(file)
        if digest != entry.sha256:
            raise CorruptCheckpointError(
                f"{file}: sha256 {digest[:12]}... does not match the manifest "
                f"({entry.sha256[:12]}...)"
            )
