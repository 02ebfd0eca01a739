"""File layout of checkpoints and published weights, and the atomic `latest_*` markers.

    checkpoints/global_step_N/                 one full checkpoint (manifest.json written last)
    checkpoints/global_step_N/huggingface/     its HF export, when saved
    checkpoints/latest_checkpointed_iteration.txt   newest complete checkpoint step
    checkpoints/latest_state_dict_iteration.txt     newest published weights version
    weights/global_step_N/                     sync-only published weights (HF format)

Weights version v is the train step that produced them; version 0 is the initial model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from trinity_dagster.paths import RunPaths

LATEST_CHECKPOINT_FILE = "latest_checkpointed_iteration.txt"
LATEST_WEIGHTS_FILE = "latest_state_dict_iteration.txt"
HF_SUBDIR = "huggingface"


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
    if (published / "config.json").is_file():
        return published
    exported = checkpoint_dir(paths, version) / HF_SUBDIR
    if (exported / "config.json").is_file():
        return exported
    raise FileNotFoundError(
        f"no weights of version {version}: neither {published} nor {exported} holds a config.json"
    )


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: temp file in the same directory, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


def latest_weights_version(paths: RunPaths) -> int | None:
    """Newest published weights version, per `latest_state_dict_iteration.txt`."""
    return read_marker(paths.checkpoints / LATEST_WEIGHTS_FILE)


def set_latest_checkpoint_step(paths: RunPaths, step: int) -> None:
    """Move the checkpoint marker to `step` (call only once its manifest exists)."""
    write_atomic(paths.checkpoints / LATEST_CHECKPOINT_FILE, f"{step}\n")


def set_latest_weights_version(paths: RunPaths, version: int) -> None:
    """Move the published-weights marker to `version` (call only once its files are complete)."""
    write_atomic(paths.checkpoints / LATEST_WEIGHTS_FILE, f"{version}\n")
