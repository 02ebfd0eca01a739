"""Publishing weights to explorers: HF directories under `weights/`, switched by an atomic marker.

A version directory `weights/global_step_N/` appears only by renaming a finished, fsynced temp
directory, and `latest_state_dict_iteration.txt` moves (never backwards) only after that. torch
is imported inside the functions that need it, so this module is cheap to import.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    discard_dir,
    fsync_dir,
    latest_weights_version,
    published_weights_dir,
    scan_step_dirs,
    scratch_dir,
    set_latest_weights_version,
)
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.paths import RunPaths

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
_NOT_TOKENIZER = {"config.json", "generation_config.json", WEIGHTS_FILE}


def advance_weights_marker(paths: RunPaths, version: int) -> None:
    """Move the published-weights marker forward to `version` (never backwards)."""
    current = latest_weights_version(paths)
    if current is None or version > current:
        set_latest_weights_version(paths, version)


def _cpu_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU copies where needed; tensors sharing storage are cloned (safetensors)."""
    import torch

    if not tensors:
        raise ValueError("publish_weights: no tensors given")
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"publish_weights: entry {name!r} must map a str to a torch.Tensor, "
                f"got {type(tensor).__name__}"
            )
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add((t.untyped_storage().data_ptr(), t.storage_offset()))
        out[name] = t
    return out


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_dir(
    out_dir: Path,
    tensors: Mapping[str, Tensor],
    hf_config: Mapping[str, Any],
    tokenizer_src: Path | None,
) -> None:
    """Write `config.json`, `model.safetensors` and the tokenizer files into `out_dir`, fsynced."""
    from safetensors.torch import save_file

    if tokenizer_src is not None and not Path(tokenizer_src).is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_src} does not exist")
    try:
        config_text = json.dumps(dict(hf_config), indent=2, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"hf_config is not JSON-serializable: {err}") from None
    cpu = _cpu_tensors(tensors)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(config_text)
    save_file(cpu, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer_src is not None:
        for src in sorted(Path(tokenizer_src).iterdir()):
            if src.is_file() and src.name not in _NOT_TOKENIZER:
                shutil.copyfile(src, out_dir / src.name)
    for file in out_dir.iterdir():
        _fsync_file(file)
    fsync_dir(out_dir)


def publish_weights(
    paths: RunPaths,
    step: int,
    tensors: Mapping[str, Tensor],
    hf_config: Mapping[str, Any],
    tokenizer_src: Path | None,
) -> Path:
    """Publish weights version `step` as an HF directory and move the weights marker to it.

    The directory is written under a hidden temp name and renamed into place; a re-publish
    of the same version replaces the old directory. Returns the published directory.
    """
    if step < 0:
        raise ValueError(f"weights version must be >= 0, got {step}")
    target = published_weights_dir(paths, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_dir(target.parent, step)
    try:
        write_hf_dir(tmp, tensors, hf_config, tokenizer_src)
        if target.exists():
            discard_dir(target, step)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
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
    if not any(f.path == f"{HF_SUBDIR}/config.json" for f in manifest.files):
        raise FileNotFoundError(
            f"checkpoint {ckpt} has no {HF_SUBDIR}/config.json; it cannot serve as the sync"
        )
    return ckpt / HF_SUBDIR


def prune_published(paths: RunPaths, keep: int) -> list[Path]:
    """Delete superseded sync-only weight directories; return what was deleted.

    Keeps the newest `keep` versions up to the marker, the version the marker names, every
    version newer than the marker, and version 0 (the initial weights). Removes temp and trash
    directories of versions older than the marker.
    """
    if keep < 1:
        raise ValueError(f"keep_synced_weights must be >= 1, got {keep}")
    current = latest_weights_version(paths)
    if current is None:
        return []
    dirs = scan_step_dirs(paths.weights)
    finals = [d for d in dirs if d.kind == "final" and d.step <= current]
    kept = {d.path for d in finals[-keep:]}
    deleted: list[Path] = []
    for entry in dirs:
        if entry.step == 0 or entry.step >= current or entry.path in kept:
            continue
        if entry.kind == "final":
            discard_dir(entry.path, entry.step)
        else:
            shutil.rmtree(entry.path)
        deleted.append(entry.path)
    return deleted
