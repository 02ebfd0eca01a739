"""File layout of checkpoints and published weights, and the atomic `latest_*` markers.

    checkpoints/global_step_N/                 one full checkpoint (manifest.json written last)
    checkpoints/global_step_N/huggingface/     its HF export, when saved
    checkpoints/latest_checkpointed_iteration.txt   newest complete checkpoint step
    checkpoints/latest_state_dict_iteration.txt     newest published weights version
    weights/global_step_N/                     sync-only published weights (HF format)
    weights/shared/<sha256>                    their config and tokenizer files, hard-linked
    .global_step_N.tmp-<hex>/                  a checkpoint or weights directory being written
    .global_step_N.trash-<hex>/                a directory being deleted

Only a `global_step_N/` directory is ever read as a version; it appears by an atomic rename of
its finished temp directory.

Weights version v is the train step that produced them; version 0 is the initial model.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.files import fsync_dir, write_text_atomic
from trinity_dagster.paths import RunPaths

LATEST_CHECKPOINT_FILE = "latest_checkpointed_iteration.txt"
LATEST_WEIGHTS_FILE = "latest_state_dict_iteration.txt"
# What a checkpoint directory `checkpoints/global_step_N/` holds, the one map of it:
MANIFEST_FILE = "manifest.json"  # written last: every file's size and sha256, sampler state
HF_SUBDIR = "huggingface"  # the HF export, when the save made one
MODEL_DESCRIPTION_DIR = "model"  # the model's HF config and tokenizer, to rebuild the model
CRITIC_DESCRIPTION_DIR = "critic_model"  # PPO's critic: its HF config, to rebuild it
ENGINE_STATE_FILE = "engine_state.json"  # the engine's step, layout and format version
DIST_DIR = "dist"  # Megatron's distributed checkpoint of the model and optimizer
RNG_DIR = "rng"  # every rank's random number generator states
_FINAL_NAME = re.compile(r"global_step_(\d+)")
_SCRATCH_NAME = re.compile(r"\.global_step_(\d+)\.(tmp|trash)-[0-9a-f]+")

DirKind = Literal["final", "tmp", "trash"]


@dataclass(frozen=True)
class StepDir:
    """A per-step directory found on disk: finished (`final`), being written, or being deleted."""

    step: int
    path: Path
    kind: DirKind


def step_dir_name(step: int) -> str:
    """`global_step_N`, Trinity-RFT's directory name for step N."""
    return f"global_step_{step}"


def checkpoint_dir(paths: RunPaths, step: int) -> Path:
    """Directory of the full checkpoint of `step`."""
    return paths.checkpoints / step_dir_name(step)


def published_weights_dir(paths: RunPaths, step: int) -> Path:
    """Directory of sync-only published weights of `step`."""
    return paths.weights / step_dir_name(step)


def weights_dir(paths: RunPaths, version: int) -> Path:
    """The HF directory holding weights `version`: published, or a checkpoint's HF export."""
    published = published_weights_dir(paths, version)
    if hf_dir_written(published):
        return published
    exported = checkpoint_dir(paths, version) / HF_SUBDIR
    if hf_dir_written(exported):
        return exported
    raise FileNotFoundError(
        f"no weights of version {version}: neither {published} nor {exported} holds a config.json"
    )


def scratch_dir(
    parent: Path, step: int, kind: Literal["tmp", "trash"] = "tmp", tag: str | None = None
) -> Path:
    """A hidden path `.global_step_N.<kind>-<hex>` under `parent` (not created).

    `tag` (hex) names it deterministically, e.g. so that every rank agrees on it; by default
    the name is random.
    """
    tag = uuid.uuid4().hex if tag is None else tag
    if not re.fullmatch(r"[0-9a-f]+", tag):
        raise ValueError(f"scratch directory tag must be lowercase hex, got {tag!r}")
    return parent / f".{step_dir_name(step)}.{kind}-{tag}"


def scan_step_dirs(parent: Path) -> list[StepDir]:
    """Every per-step directory under `parent`, sorted by step (final before scratch)."""
    found: list[StepDir] = []
    if not parent.is_dir():
        return found
    for entry in parent.iterdir():
        if not entry.is_dir() or entry.is_symlink():
            continue
        if match := _FINAL_NAME.fullmatch(entry.name):
            found.append(StepDir(int(match.group(1)), entry, "final"))
        elif match := _SCRATCH_NAME.fullmatch(entry.name):
            kind: DirKind = "tmp" if match.group(2) == "tmp" else "trash"
            found.append(StepDir(int(match.group(1)), entry, kind))
    order = {"final": 0, "tmp": 1, "trash": 2}
    return sorted(found, key=lambda d: (d.step, order[d.kind], d.path.name))


def read_marker(path: Path) -> int | None:
    """The step stored in a `latest_*` marker file, or None if there is none."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"corrupt marker file {path}: expected a step number, got {text!r}")
    return int(text)


def latest_checkpoint_step(paths: RunPaths) -> int | None:
    """Step of the newest complete checkpoint, per `latest_checkpointed_iteration.txt`."""
    return read_marker(paths.checkpoints / LATEST_CHECKPOINT_FILE)


def weights_versions_on_disk(paths: RunPaths) -> list[int]:
    """The weights versions an explorer or evaluation can load now, ascending: published
    ones up to the marker, and every checkpoint's HF export."""
    published = latest_weights_version(paths) or 0
    versions = {
        e.step for e in scan_step_dirs(paths.weights) if e.kind == "final" and e.step <= published
    }
    versions |= {
        e.step
        for e in scan_step_dirs(paths.checkpoints)
        if e.kind == "final" and hf_dir_written(e.path / HF_SUBDIR)
    }
    return sorted(versions)


def latest_weights_version(paths: RunPaths) -> int | None:
    """Newest published weights version, per `latest_state_dict_iteration.txt`."""
    return read_marker(paths.checkpoints / LATEST_WEIGHTS_FILE)


def set_latest_checkpoint_step(paths: RunPaths, step: int) -> None:
    """Move the checkpoint marker to `step` (call only once its manifest exists)."""
    write_text_atomic(paths.checkpoints / LATEST_CHECKPOINT_FILE, f"{step}\n")


def advance_checkpoint_marker(paths: RunPaths, step: int) -> None:
    """Move the checkpoint marker forward to `step` (never backwards; once its manifest exists)."""
    current = latest_checkpoint_step(paths)
    if current is None or step > current:
        set_latest_checkpoint_step(paths, step)


def set_latest_weights_version(paths: RunPaths, version: int) -> None:
    """Move the published-weights marker to `version` (call only once its files are complete)."""
    write_text_atomic(paths.checkpoints / LATEST_WEIGHTS_FILE, f"{version}\n")


def discard_dir(path: Path, step: int) -> None:
    """Delete a per-step directory crash-safely: rename it to a `trash` name first, then remove.

    A crash midway leaves a `.global_step_N.trash-*` directory, never a damaged `global_step_N/`.
    """
    trash = scratch_dir(path.parent, step, "trash")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)
