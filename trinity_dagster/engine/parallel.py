"""The torch.distributed process group and Megatron's model-parallel groups for the engine.

Works under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the
environment) and in a plain single process (world size 1, rendezvous through a file
store, nothing bound to a port). gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from trinity_dagster.config import MegatronConfig, is_loopback_host
from trinity_dagster.engine.cpu_compat import enable_cpu_compat

_store_file: Path | None = None


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits in the engine's process grid."""

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str
    device: torch.device
    cpu_compat: bool

    @property
    def is_rank0(self) -> bool:
        """True on global rank 0, the rank that writes files and serves the control API."""
        return self.rank == 0


def init_distributed(megatron_cfg: MegatronConfig, seed: int) -> ParallelInfo:
    """Initialize torch.distributed, Megatron's parallel groups and its RNG streams.

    Raises ValueError when the world size is not tp * pp * dp, RuntimeError when Megatron's
    parallel state is already initialized in this process.
    """
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel state is already initialized in this process; "
            "call destroy_distributed() first"
        )
    cpu = enable_cpu_compat()
    backend = "gloo" if cpu else "nccl"
    world_size, rank, local_rank = _launch_env()
    tp = megatron_cfg.tensor_model_parallel_size
    pp = megatron_cfg.pipeline_model_parallel_size
    dp = megatron_cfg.data_parallel_size
    if world_size != tp * pp * dp:
        raise ValueError(
            f"world size {world_size} (WORLD_SIZE from the launcher) does not equal "
            f"megatron.tensor_model_parallel_size ({tp}) * pipeline_model_parallel_size ({pp}) "
            f"* data_parallel_size ({dp}) = {tp * pp * dp}"
        )
    if cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        _init_process_group(backend, world_size, rank)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    _seed_everything(seed + 100 * pp_rank)
    return ParallelInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=pp_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        backend=backend,
        device=device,
        cpu_compat=cpu,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel groups and the process group; safe to call twice."""
    global _store_file
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _store_file is not None:
        _store_file.unlink(missing_ok=True)
        _store_file = None


def launched_by_agent() -> bool:
    """Whether torchrun's agent started this process (it sets WORLD_SIZE); otherwise it runs
    alone, a single process."""
    return "WORLD_SIZE" in os.environ


def _launch_env() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) from torchrun's environment, or a single process."""
    if not launched_by_agent():
        return 1, 0, 0
    try:
        world_size = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"invalid launcher environment: WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
            f"RANK={os.environ.get('RANK')!r} LOCAL_RANK={os.environ.get('LOCAL_RANK')!r} "
            f"({err})"
        ) from None
    return world_size, rank, local_rank


def _init_process_group(backend: str, world_size: int, rank: int) -> None:
    global _store_file
    if "MASTER_ADDR" in os.environ:
        if backend == "gloo" and is_loopback_host(os.environ["MASTER_ADDR"]):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, world_size=world_size, rank=rank)
        return
    if world_size != 1:
        raise ValueError(
            f"WORLD_SIZE is {world_size} but MASTER_ADDR is not set; launch with torchrun"
        )
    fd, name = tempfile.mkstemp(prefix="trinity-dagster-pg-")
    os.close(fd)
    _store_file = Path(name)
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(name, 1)
    dist.init_process_group(backend, store=store, world_size=1, rank=0)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
