"""Checkpoint retention: keep the newest `max_checkpoints_to_keep` complete checkpoints on disk.

Counts from what is on disk, so it survives restarts. Never deletes the newest checkpoint that
verifies with checksums, one being written, the checkpoint whose HF export is the published
weights, or a complete one of the steps the caller keeps (the SFT model); a damaged newer
checkpoint never costs an older good one.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection
from pathlib import Path

from trinity_dagster.checkpoint.layout import (
    StepDir,
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


def _kept(complete: list[StepDir], max_keep: int | None, hashed: Collection[Path]) -> list[StepDir]:
    """The complete checkpoints to keep, newest first.

    All of them while they fit in `max_keep`; otherwise the newest `max_keep` that verify with
    checksums (those in `hashed` are taken as verified), so a damaged newer checkpoint is never
    counted in place of an older good one.
    """
    if max_keep is None or len(complete) <= max_keep:
        return complete[::-1]
    kept: list[StepDir] = []
    for entry in reversed(complete):
        if entry.path not in hashed:
            try:
                verify_checkpoint(entry.path, checksums=True)
            except CorruptCheckpointError as err:
                log.warning("retention does not count checkpoint %s: %s", entry.path, err)
                continue
        kept.append(entry)
        if len(kept) == max_keep:
            break
    return kept


def prune_checkpoints(
    paths: RunPaths,
    max_keep: int | None,
    *,
    in_progress: Collection[Path] = (),
    hashed: Collection[Path] = (),
    keep_step: int | None = None,
) -> list[Path]:
    """Delete surplus checkpoints; return the directories deleted.

    Keeps the newest `max_keep` complete checkpoints (None keeps all), and that of step
    `keep_step` without counting it (the SFT model); before any complete one is
    deleted, those kept are verified with checksums, except the `hashed` ones (the caller
    computed their manifests from the files it wrote). Removes partial or corrupt `global_step_N/`
    and abandoned temp directories up to the newest kept checkpoint's step, and leftover trash.
    `in_progress` directories are never touched. Completeness is otherwise judged by manifest,
    presence and size. Safe to run while another process prunes too.
    """
    if max_keep is not None and max_keep < 1:
        raise ValueError(f"max_checkpoints_to_keep must be >= 1 or None, got {max_keep}")
    busy = {Path(p).resolve() for p in in_progress}
    dirs = [d for d in scan_step_dirs(paths.checkpoints) if d.path.resolve() not in busy]
    complete = [d for d in dirs if d.kind == "final" and is_complete(d.path)]
    counted = [d for d in complete if d.step != keep_step]
    kept = _kept(counted, max_keep, set(hashed))
    newest = kept[0].step if kept else None
    protected = _published_checkpoint(paths)
    deleted: list[Path] = []
    for entry in dirs:
        if entry in kept or entry.path == protected:
            continue
        if entry in complete and entry.step == keep_step:
            continue
        if entry.kind != "trash":
            if newest is None or entry.step > newest:
                continue
            if entry not in complete:
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
