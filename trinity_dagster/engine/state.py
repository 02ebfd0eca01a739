"""The engine's resumable state on disk: Megatron dist-checkpoint, per-rank RNG, step marker.

Layout of a state directory (every rank takes part in writing and reading it):

    dist/                 model + optimizer + LR scheduler (megatron.core.dist_checkpointing)
    rng/rank_NNNNN.pt     this rank's RNG states (python, numpy, torch, CUDA, Megatron tracker)
    engine_state.json     {"format": 1, "step": N, "layout": {...}}, written by rank 0 last:
                          the state is complete

How the `dist/` tensors are written in the background is `async_save`'s business.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from trinity_dagster.checkpoint.layout import DIST_DIR, ENGINE_STATE_FILE, RNG_DIR
from trinity_dagster.engine.async_save import EngineStateSave, SaveQueue, save_sharded
from trinity_dagster.files import write_text_atomic

FORMAT_VERSION = 1

log = logging.getLogger(__name__)


class EngineStateError(RuntimeError):
    """A state directory is missing, incomplete or does not fit this engine."""


@dataclass(frozen=True)
class Layout:
    """The parallel layout a state was written with."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU, CUDA, Megatron's RNG tracker."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's RNG states to `state` (from `capture_rng_state`)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_engine_state(
    ckpt_dir: Path,
    sharded_state_dict: dict[str, Any],
    *,
    step: int,
    layout: Layout,
    queue: SaveQueue | None,
) -> EngineStateSave:
    """Write a state directory; with a `queue`, the tensors are written in the background.

    `engine_state.json` is written by rank 0 after every rank's tensors are on disk, so a
    directory without it is an incomplete save.
    """
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank()
    if rank == 0:
        (ckpt_dir / DIST_DIR).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / RNG_DIR).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / ENGINE_STATE_FILE).unlink(missing_ok=True)
    dist.barrier()
    torch.save(capture_rng_state(), _rng_file(ckpt_dir, rank))

    def write_marker() -> None:
        if dist.get_rank() == 0:
            meta = {"format": FORMAT_VERSION, "step": step, "layout": layout.__dict__}
            write_text_atomic(ckpt_dir / ENGINE_STATE_FILE, json.dumps(meta, indent=2))
        dist.barrier()

    return save_sharded(sharded_state_dict, ckpt_dir / DIST_DIR, queue=queue, finalize=write_marker)


def read_engine_state(ckpt_dir: Path) -> dict[str, Any]:
    """The metadata of a complete state directory; EngineStateError if it is not one."""
    marker = Path(ckpt_dir) / ENGINE_STATE_FILE
    if not marker.is_file():
        raise EngineStateError(
            f"{ckpt_dir} is not a complete engine state: {ENGINE_STATE_FILE} is missing "
            "(the save never finished, or this is not a state directory)"
        )
    meta = json.loads(marker.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise EngineStateError(
            f"{marker}: format {meta.get('format')!r} is not supported (expected {FORMAT_VERSION})"
        )
    return meta


def load_engine_state(
    ckpt_dir: Path, sharded_state_dict: dict[str, Any], layout: Layout
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(loaded state dict, metadata) of a complete state directory; restores this rank's RNG.

    The RNG states are restored only when the layout matches the one saved (otherwise the
    weights and optimizer are resharded by dist_checkpointing and a warning is logged).
    """
    meta = read_engine_state(ckpt_dir)
    loaded = dist_checkpointing.load(sharded_state_dict, str(Path(ckpt_dir) / DIST_DIR))
    rng_file = _rng_file(Path(ckpt_dir), dist.get_rank())
    if meta["layout"] == layout.__dict__ and rng_file.is_file():
        restore_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning(
            "engine state %s was saved with layout %s, this engine has %s: RNG states not "
            "restored, resume is not bit-exact",
            ckpt_dir,
            meta["layout"],
            layout.__dict__,
        )
    return loaded, meta


def _rng_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / RNG_DIR / f"rank_{rank:05d}.pt"
