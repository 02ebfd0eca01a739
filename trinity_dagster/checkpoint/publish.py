"""Publishing weights to explorers: HF directories under `weights/`, switched by an atomic marker.

A version directory `weights/global_step_N/` appears only by renaming a finished, fsynced temp
directory, and `latest_state_dict_iteration.txt` moves (never backwards) only after that. torch
is imported only when writing (see `hf_dir`), so this module is cheap to import.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trinity_dagster.checkpoint.hf_dir import CONFIG_FILE, write_hf_dir
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    discard_dir,
    latest_weights_version,
    published_weights_dir,
    scan_step_dirs,
    scratch_dir,
    set_latest_weights_version,
    weights_dir,
)
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.checkpoint.shared_files import SharedFiles
from trinity_dagster.checkpoint.weights_holds import held_versions
from trinity_dagster.faults import fault_point
from trinity_dagster.files import fsync_dir
from trinity_dagster.handoff.wakeup import EXPLORER, wake
from trinity_dagster.paths import RunPaths

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)


def advance_weights_marker(paths: RunPaths, version: int) -> None:
    """Move the published-weights marker forward to `version` (never backwards), and wake the
    explorers waiting for weights then, not when the trainer hears of it."""
    current = latest_weights_version(paths)
    if current is None or version > current:
        set_latest_weights_version(paths, version)
        wake(paths.wakeup, EXPLORER)


def publish_weights(
    paths: RunPaths,
    step: int,
    tensors: Mapping[str, Tensor],
    hf_config: Mapping[str, Any],
    source_dir: Path | None,
) -> Path:
    """Publish weights version `step` as an HF directory and move the weights marker to it.

    The directory is `hf_dir.write_hf_dir`'s (tokenizer files and generation config from the
    model's `source_dir`), written under a hidden temp name and renamed into place; its config
    and model files are hard links to the copies under `weights/shared/`. A re-publish of the
    same version replaces the old directory. Returns the published directory.
    """
    if step < 0:
        raise ValueError(f"weights version must be >= 0, got {step}")
    target = published_weights_dir(paths, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_dir(target.parent, step)
    try:
        shared = SharedFiles(paths.weights_shared)
        write_hf_dir(tmp, tensors, hf_config, source_dir, fresh=True, shared=shared)
        fault_point("weights_publish", step)
        if target.exists():
            discard_dir(target, step)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    fault_point("weights_renamed", step)
    advance_weights_marker(paths, step)
    log.info("published weights version %d at %s", step, target)
    return target


def record_sync_from_checkpoint(paths: RunPaths, step: int) -> Path:
    """Make checkpoint `step`'s `huggingface/` export the published weights version `step`.

    Used when a full save serves as the sync (sync_method `checkpoint`): nothing is copied.
    Returns the HF directory explorers load.
    """
    directory = checkpoint_sync_dir(paths, step)
    advance_weights_marker(paths, step)
    return directory


def checkpoint_sync_dir(paths: RunPaths, step: int) -> Path:
    """The `huggingface/` export of complete checkpoint `step`, which can serve as the sync."""
    ckpt = checkpoint_dir(paths, step)
    manifest = verify_checkpoint(ckpt, checksums=False)
    if not any(f.path == f"{HF_SUBDIR}/{CONFIG_FILE}" for f in manifest.files):
        raise FileNotFoundError(
            f"checkpoint {ckpt} has no {HF_SUBDIR}/{CONFIG_FILE}; it cannot serve as the sync"
        )
    return ckpt / HF_SUBDIR


def published_info(paths: RunPaths, version: int) -> dict[str, Any] | None:
    """Version, directory and size of weights `version` if they are published, else None."""
    if version > (latest_weights_version(paths) or 0):
        return None
    try:
        directory = weights_dir(paths, version)
    except FileNotFoundError:
        return None
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    return {"version": version, "path": str(directory), "size_bytes": size}


def prune_published(paths: RunPaths, keep: int) -> list[Path]:
    """Delete superseded sync-only weight directories; return what was deleted.

    Keeps the newest `keep` versions up to the marker, the version the marker names, every
    version newer than the marker, version 0 (the initial weights) and every version a
    reader holds (`weights_holds`). Removes temp and trash directories of versions older than
    the marker.
    """
    if keep < 1:
        raise ValueError(f"keep_synced_weights must be >= 1, got {keep}")
    current = latest_weights_version(paths)
    if current is None:
        return []
    dirs = scan_step_dirs(paths.weights)
    finals = [d for d in dirs if d.kind == "final" and d.step <= current]
    kept = {d.path for d in finals[-keep:]}
    held = held_versions(paths)
    deleted: list[Path] = []
    for entry in dirs:
        if entry.step == 0 or entry.step >= current or entry.path in kept:
            continue
        if entry.kind == "final" and entry.step in held:
            continue
        if entry.kind == "final":
            discard_dir(entry.path, entry.step)
        else:
            shutil.rmtree(entry.path)
        deleted.append(entry.path)
    return deleted
