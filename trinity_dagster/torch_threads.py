"""How one machine's CPU cores are shared between the built-in explorer's torch and the engine
ranks' torch.

On a machine where both compute at once, each takes its own share of the cores: more torch
threads than cores make every parallel region wait for a thread that is not running.
"""

from __future__ import annotations

from trinity_dagster.config import SyncStyle, TrinityConfig


def explorer_runs_alone(config: TrinityConfig) -> bool:
    """True when the built-in explorer only generates while training waits for its rows
    (`sync_style: fixed`, `sync_interval: 1`, `sync_offset: 0`), never beside a train step."""
    sync = config.synchronizer
    return sync.sync_style is SyncStyle.FIXED and sync.sync_interval == 1 and not sync.sync_offset


def explorer_torch_threads(config: TrinityConfig, cores: int) -> int:
    """Torch threads of the built-in explorer on a machine with `cores` cores:
    `explorer.torch_threads`, else all cores but one when it runs alone and half of them when
    it generates beside training (at least one). The core an explorer running alone leaves is
    for what works beside it then: the trainer's run worker logging the step just trained,
    the Delta commits, the engine's housekeeping."""
    if config.explorer.torch_threads is not None:
        return config.explorer.torch_threads
    return max(1, cores - 1 if explorer_runs_alone(config) else cores // 2)


def engine_torch_threads(config: TrinityConfig, cores: int) -> int:
    """Torch threads of each engine rank on a machine with `cores` cores:
    `trainer.torch_threads`, else the cores the built-in explorer leaves when it generates
    beside training on the same machine (an engine of one node), shared by the node's ranks
    (at least one each)."""
    if config.trainer.torch_threads is not None:
        return config.trainer.torch_threads
    free = cores
    beside = config.dagster.builtin_explorer and not explorer_runs_alone(config)
    if beside and config.service.nnodes == 1:
        free -= explorer_torch_threads(config, cores)
    ranks = config.service.procs_per_node(config.megatron.world_size)
    return max(1, free // ranks)
