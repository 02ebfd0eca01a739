"""Checkpoint retention: keep the newest `max_checkpoints_to_keep` complete checkpoints on disk.

Counts from what is on disk, so it survives restarts. Never deletes the newest complete
checkpoint, one being written, or the checkpoint whose HF export is the published weights.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection
from pathlib import Path

from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    discard_dir,
    latest_weights_version,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint
from trinity_dagster.paths import RunPaths

log = logging.getLogger(__name__)


def is_complete(ckpt_dir: Path, *, checksums: bool = False) -> bool:
    """Whether `ckpt_dir` has a valid manifest whose files are all present with their sizes."""
    try:
        verify_checkpoint(ckpt_dir, checksums=checksums)
    except CorruptCheckpointError:
        return False
    return True


def _published_checkpoint(paths: RunPaths) -> Path | None:
    """The checkpoint directory whose `huggingface/` is the newest published weights, if any."""
    version = latest_weights_version(paths)
    if version is None:
        return None
    try:
        served = weights_dir(paths, version)
    except FileNotFoundError:
        return None
    ckpt = checkpoint_dir(paths, version)
    return ckpt if served.is_relative_to(ckpt) else None


def prune_checkpoints(
    paths: RunPaths, max_keep: int | None, *, in_progress: Collection[Path] = ()
) -> list[Path]:
    """Delete surplus checkpoints; return the directories deleted.

    Keeps the newest `max_keep` complete checkpoints (None keeps all). Removes partial or corrupt
    `global_step_N/` and abandoned temp directories up to the newest complete checkpoint's step,
    and leftover trash. `in_progress` directories are never touched. Completeness is judged by
    manifest, presence and size (no checksums). Safe to run while another process prunes too.
    """
    if max_keep is not None and max_keep < 1:
        raise ValueError(f"max_checkpoints_to_keep must be >= 1 or None, got {max_keep}")
    busy = {Path(p).resolve() for p in in_progress}
    dirs = [d for d in scan_step_dirs(paths.checkpoints) if d.path.resolve() not in busy]
    complete = [d for d in dirs if d.kind == "final" and is_complete(d.path)]
    kept = {d.path for d in (complete[-max_keep:] if max_keep else complete)}
    newest = complete[-1].step if complete else None
    protected = _published_checkpoint(paths)
    deleted: list[Path] = []
    for entry in dirs:
        if entry.path in kept or entry.path == protected:
            continue
        if entry.kind != "trash" and entry not in complete:
            if newest is None or entry.step > newest:
                continue
            log.warning("removing incomplete checkpoint directory %s", entry.path)
        try:
            if entry.kind == "trash":
                shutil.rmtree(entry.path)
            else:
                discard_dir(entry.path, entry.step)
        except FileNotFoundError:
            continue  # another pruner (the service or a schedule) removed it first
        log.info("retention deleted %s", entry.path)
        deleted.append(entry.path)
    return deleted
