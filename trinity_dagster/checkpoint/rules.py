"""When weights go to explorers (Trinity-RFT's sync rules), as pure functions. No torch here.

The trainer loop (`trinity_dagster.trainer.Trainer`) asks `need_sync` after each step; the
built-in explorer asks `explorer_weights_version` which version an explore step needs;
`sft_model_step` names the checkpoint kept as the SFT model.
"""

from __future__ import annotations

import math

from trinity_dagster.config import SynchronizerConfig, SyncMethod, SyncStyle, TrinityConfig


def _check_step(step: int, name: str = "step") -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {step!r}")


def need_sync(
    step: int,
    *,
    sync_interval: int,
    last_sync_step: int,
    style: SyncStyle = SyncStyle.FIXED,
    explorer_requested: bool = False,
) -> bool:
    """Whether weights of train step `step` must be synced to explorers.

    `fixed`, `trainer_driven`, `fully_async`: `step != last_sync_step and step %
    sync_interval == 0` (they differ on the explorers' side: `explorer_waits_for_weights`).
    `explorer_driven`: `step != last_sync_step` and an explorer has asked for new weights.
    """
    _check_step(step)
    _check_step(last_sync_step, "last_sync_step")
    if sync_interval < 1:
        raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
    if style not in set(SyncStyle):
        raise ValueError(f"unknown sync style {style!r}")
    if step == last_sync_step:
        return False
    if style == SyncStyle.EXPLORER_DRIVEN:
        return explorer_requested
    return step % sync_interval == 0


def explorer_waits_for_weights(sync: SynchronizerConfig) -> bool:
    """Whether an explore step waits for the weights version its step needs
    (`explorer_weights_version`), as Trinity-RFT's explorers do under `fixed`, and under
    `trainer_driven` with weights published as files or in shared memory (they pull the
    trainer's next version at their sync points). Under `trainer_driven` with `nccl` they take
    a version only if the trainer has one ready, and under `fully_async` they never wait."""
    if sync.sync_style is SyncStyle.TRAINER_DRIVEN:
        return sync.sync_method is not SyncMethod.NCCL
    return sync.sync_style is SyncStyle.FIXED


def is_explorer_sync_point(explore_step: int, sync: SynchronizerConfig) -> bool:
    """Whether explorers take new weights before explore step `explore_step` (1-based):
    after every `sync_interval` explore steps past the first `sync_offset`."""
    done = explore_step - 1 - sync.sync_offset
    return done > 0 and done % sync.sync_interval == 0


def explorer_weights_version(explore_step: int, *, sync_interval: int, sync_offset: int) -> int:
    """The weights version explore step `explore_step` (1-based) runs with, style `fixed`.

    The explorer syncs after explore steps `sync_offset + k * sync_interval` (k >= 1) and then
    holds the trainer's k-th synced version `k * sync_interval`. Hence explore step E uses
    version `max(0, (E - 1 - sync_offset) // sync_interval) * sync_interval`, which is at least
    `E - sync_offset - sync_interval`: `sync_offset` is how many explore steps explorers may run
    ahead of the trainer before they wait for weights.
    """
    if explore_step < 1:
        raise ValueError(f"explore_step must be >= 1, got {explore_step}")
    if sync_interval < 1 or sync_offset < 0:
        raise ValueError(
            f"need sync_interval >= 1 and sync_offset >= 0, got {sync_interval} and {sync_offset}"
        )
    return max(0, (explore_step - 1 - sync_offset) // sync_interval) * sync_interval


def explore_steps_needed(config: TrinityConfig) -> int | None:
    """Explore steps of the built-in explorer whose experiences fill `trainer.total_steps`
    (None when it is unset: the explorer goes on until its task set is used up).

    Each SFT warm-up step takes one explore step of demonstrations; each RL step takes
    `buffer.train_batch_size` rows, `explorer.tasks_per_step * algorithm.repeat_times` per
    explore step.
    """
    total = config.trainer.total_steps
    if total is None:
        return None
    sft = min(config.trainer.sft_warmup_steps, total)
    per_step = config.explorer.tasks_per_step * config.algorithm.repeat_times
    return sft + math.ceil((total - sft) * config.buffer.train_batch_size / per_step)


def sft_model_step(config: TrinityConfig) -> int | None:
    """The step whose checkpoint is the SFT model: the warm-up's last step when RL steps follow
    it (`0 < trainer.sft_warmup_steps < trainer.total_steps`, or any warm-up when
    `total_steps` is unset), else None. The trainer saves it and retention keeps it."""
    warmup, total = config.trainer.sft_warmup_steps, config.trainer.total_steps
    return warmup if warmup > 0 and (total is None or warmup < total) else None
