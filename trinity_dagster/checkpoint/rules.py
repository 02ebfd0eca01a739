"""When a train step syncs weights to explorers and when it saves a checkpoint (Trinity-RFT rules).

Pure functions of the step number and the configuration: the Dagster sensors and the engine
service ask the same questions and get the same answers. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trinity_dagster.config import TrinityConfig

SyncStyle = Literal["fixed", "explorer_driven"]
SaveHfMode = Literal["always", "last", "never"]


def _check_step(step: int, name: str = "step") -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {step!r}")


def need_sync(
    step: int,
    *,
    sync_interval: int,
    last_sync_step: int,
    style: SyncStyle = "fixed",
    explorer_requested: bool = False,
) -> bool:
    """Whether weights of train step `step` must be synced to explorers.

    `fixed`: `step != last_sync_step and step % sync_interval == 0`.
    `explorer_driven`: `step != last_sync_step` and an explorer has asked for new weights.
    """
    _check_step(step)
    _check_step(last_sync_step, "last_sync_step")
    if sync_interval < 1:
        raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
    if step == last_sync_step:
        return False
    if style == "fixed":
        return step % sync_interval == 0
    if style == "explorer_driven":
        return explorer_requested
    raise ValueError(f"unknown sync style {style!r}: expected 'fixed' or 'explorer_driven'")


def need_save(step: int, *, save_interval: int, total_steps: int) -> bool:
    """Whether train step `step` saves a full checkpoint: every `save_interval`, and the last."""
    _check_step(step)
    if save_interval < 0:
        raise ValueError(f"save_interval must be >= 0, got {save_interval}")
    if step == total_steps:
        return True
    return save_interval > 0 and step > 0 and step % save_interval == 0


def need_hf_export(step: int, *, save_hf_checkpoint: SaveHfMode, total_steps: int) -> bool:
    """Whether a full save of `step` also exports a Hugging Face directory."""
    if save_hf_checkpoint == "always":
        return True
    if save_hf_checkpoint == "last":
        return step == total_steps
    if save_hf_checkpoint == "never":
        return False
    raise ValueError(
        f"unknown save_hf_checkpoint {save_hf_checkpoint!r}: expected 'always', 'last' or 'never'"
    )


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


@dataclass(frozen=True)
class StepPlan:
    """What happens after train step N.

    save: write a full checkpoint. save_hf: the checkpoint includes `huggingface/`.
    sync: explorers get weights version N. save_serves_as_sync: the sync is the checkpoint's
    HF export (sync_method `checkpoint`), so no separate weights are published.
    blocking: the save finishes before the step returns (only the final save).
    """

    step: int
    save: bool
    save_hf: bool
    sync: bool
    save_serves_as_sync: bool
    blocking: bool

    @property
    def publish(self) -> bool:
        """Whether weights must be published separately (a sync not covered by a save)."""
        return self.sync and not self.save_serves_as_sync


def plan_step(
    step: int, config: TrinityConfig, last_sync_step: int, *, explorer_requested: bool = False
) -> StepPlan:
    """The save/sync plan of train step `step` under `config` (DESIGN §5)."""
    trainer, sync_cfg = config.trainer, config.synchronizer
    if step < 1 or step > trainer.total_steps:
        raise ValueError(f"step {step} is outside 1..trainer.total_steps ({trainer.total_steps})")
    save = need_save(step, save_interval=trainer.save_interval, total_steps=trainer.total_steps)
    sync = need_sync(
        step,
        sync_interval=sync_cfg.sync_interval,
        last_sync_step=last_sync_step,
        style=sync_cfg.sync_style,
        explorer_requested=explorer_requested,
    )
    serves = save and sync and sync_cfg.sync_method == "checkpoint"
    save_hf = save and (
        serves
        or need_hf_export(
            step, save_hf_checkpoint=trainer.save_hf_checkpoint, total_steps=trainer.total_steps
        )
    )
    return StepPlan(
        step=step,
        save=save,
        save_hf=save_hf,
        sync=sync,
        save_serves_as_sync=serves,
        blocking=save and step == trainer.total_steps,
    )
