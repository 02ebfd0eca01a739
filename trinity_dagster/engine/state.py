"""The engine's resumable state on disk: Megatron dist-checkpoint, per-rank RNG, step marker.

Layout of a state directory (every rank takes part in writing and reading it):

    dist/                 model + optimizer + LR scheduler (megatron.core.dist_checkpointing)
    rng/rank_NNNNN.pt     this rank's RNG states (python, numpy, torch, CUDA, Megatron tracker)
    engine_state.json     {"step": N, ...}, written by rank 0 last: the state is complete

Background saves use dist_checkpointing's async save: the tensors are written by a forked
process (a copy-on-write snapshot taken when the save starts), so training may go on.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

STATE_FILE = "engine_state.json"
DIST_DIR = "dist"
RNG_DIR = "rng"
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


class SaveQueue:
    """Background saves in flight, over Megatron's `AsyncCallsQueue`; methods are collective."""

    def __init__(self) -> None:
        self._calls = AsyncCallsQueue()
        self._finalized: set[int] = set()

    def schedule(self, request: Any) -> int:
        """Start writing `request` in a background process; its call index."""
        return self._calls.schedule_async_request(request)

    def finalize(self, *, blocking: bool) -> None:
        """Finalize the saves whose writers finished (all of them when `blocking`)."""
        self._finalized.update(self._calls.maybe_finalize_async_calls(blocking=blocking))

    def is_finalized(self, call_idx: int) -> bool:
        """Whether the save with index `call_idx` is complete."""
        return call_idx in self._finalized

    def close(self) -> None:
        """Wait for every pending save."""
        self.finalize(blocking=True)
        self._calls.close()


class SaveHandle:
    """A state save in progress. `done()` and `wait()` are collective: call them on every rank."""

    def __init__(self, ckpt_dir: Path, queue: SaveQueue | None = None, call_idx: int = -1):
        self.ckpt_dir = ckpt_dir
        self._queue = queue
        self._call_idx = call_idx

    def done(self) -> bool:
        """Whether the save is complete (finalizes it if its writer has finished)."""
        if self._queue is None:
            return True
        if not self._queue.is_finalized(self._call_idx):
            self._queue.finalize(blocking=False)
        return self._queue.is_finalized(self._call_idx)

    def wait(self) -> None:
        """Block until the save is complete; raises if writing failed on any rank."""
        if self._queue is not None and not self._queue.is_finalized(self._call_idx):
            self._queue.finalize(blocking=True)


def save_engine_state(
    ckpt_dir: Path,
    sharded_state_dict: dict[str, Any],
    *,
    step: int,
    layout: Layout,
    queue: SaveQueue | None,
) -> SaveHandle:
    """Write a state directory; with a `queue`, the tensors are written in the background.

    `engine_state.json` is written by rank 0 after every rank's tensors are on disk, so a
    directory without it is an incomplete save.
    """
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank()
    if rank == 0:
        (ckpt_dir / DIST_DIR).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / RNG_DIR).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / STATE_FILE).unlink(missing_ok=True)
    dist.barrier()
    torch.save(capture_rng_state(), _rng_file(ckpt_dir, rank))

    def write_marker() -> None:
        if dist.get_rank() == 0:
            meta = {"format": FORMAT_VERSION, "step": step, "layout": layout.__dict__}
            _atomic_write(ckpt_dir / STATE_FILE, json.dumps(meta, indent=2))
        dist.barrier()

    request = dist_checkpointing.save(
        sharded_state_dict, str(ckpt_dir / DIST_DIR), async_sharded_save=queue is not None
    )
    if queue is None:
        write_marker()
        return SaveHandle(ckpt_dir)
    request.finalize_fns.append(write_marker)
    return SaveHandle(ckpt_dir, queue, queue.schedule(request))


def read_engine_state(ckpt_dir: Path) -> dict[str, Any]:
    """The metadata of a complete state directory; EngineStateError if it is not one."""
    marker = Path(ckpt_dir) / STATE_FILE
    if not marker.is_file():
        raise EngineStateError(
            f"{ckpt_dir} is not a complete engine state: {STATE_FILE} is missing "
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
