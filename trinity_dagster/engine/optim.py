"""A model's training parts: Megatron DDP wrapper, optimizer and learning-rate scheduler,
built from the typed config (the actor's `trainer.optim`, the critic's `critic.optim`), and
one update of such a model through Megatron's schedule (`run_update`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule

from trinity_dagster.config import MegatronConfig, OptimConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def optimizer_config(optim: OptimConfig, megatron: MegatronConfig) -> OptimizerConfig:
    """Megatron's `OptimizerConfig` for the actor: Adam/AdamW, clipping, precision."""
    bf16 = megatron.params_dtype == "bfloat16"
    return OptimizerConfig(
        optimizer="adam",
        decoupled_weight_decay=optim.optimizer == "adamw",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.grad_clip,
        bf16=bf16,
        params_dtype=_DTYPES[megatron.params_dtype],
        use_distributed_optimizer=megatron.use_distributed_optimizer,
    )


def build_optimizer(
    model_chunks: list[MegatronModule], optim: OptimConfig, megatron: MegatronConfig
) -> MegatronOptimizer:
    """The Megatron optimizer over the DDP-wrapped `model_chunks`."""
    return get_megatron_optimizer(optimizer_config(optim, megatron), model_chunks)


def build_scheduler(
    optimizer: MegatronOptimizer, optim: OptimConfig, total_steps: int | None
) -> OptimizerParamScheduler:
    """The LR schedule, stepped once per train step: constant or cosine, with linear warmup.

    Step N trains with the learning rate of schedule position N-1: with warmup W > 0 the rate
    rises linearly from 0 at step 1 to `lr` at step W+1 (the convention of Megatron and HF);
    cosine then decays to `min_lr` at `total_steps` (which a cosine schedule needs; None:
    training until the data ends).
    """
    if optim.lr_scheduler == "cosine" and total_steps is None:
        raise ValueError("the cosine schedule needs trainer.total_steps")
    total_steps = total_steps or 0
    if optim.lr_warmup_steps >= max(total_steps, 1) and optim.lr_scheduler == "cosine":
        raise ValueError(
            f"trainer.optim.lr_warmup_steps ({optim.lr_warmup_steps}) must be smaller than "
            f"trainer.total_steps ({total_steps}) for the cosine schedule"
        )
    decay_steps = max(total_steps, optim.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if optim.lr_scheduler == "cosine" else optim.lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_scheduler,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for part in chained for inner in torch_optimizers(part)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def has_stepped(optimizer: MegatronOptimizer) -> bool:
    """Whether the optimizer has made a step, so that it holds state (Adam's moments) to save.

    A model that has not been updated yet (the actor during the critic's warm-up, the critic
    during SFT steps) has an optimizer with nothing to save or restore.
    """
    return any(inner.state for inner in torch_optimizers(optimizer))


def prepare_training(
    gpt: GPTModel, optim: OptimConfig, megatron: MegatronConfig, total_steps: int | None
) -> tuple[DistributedDataParallel, MegatronOptimizer, OptimizerParamScheduler]:
    """`gpt` wrapped in Megatron's DDP (grads reduced in fp32), its optimizer and LR schedule,
    wired into its config as Megatron's schedules expect."""
    model = DistributedDataParallel(
        config=gpt.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=megatron.use_distributed_optimizer,
        ),
        module=gpt,
    )
    gpt.config.no_sync_func = model.no_sync
    gpt.config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer([model], optim, megatron)
    gpt.config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, build_scheduler(optimizer, optim, total_steps)


def run_update(
    model: DistributedDataParallel,
    optimizer: MegatronOptimizer,
    forward_step: Callable[..., Any],
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    grad_clip: float,
    before_update: Callable[[], None],
    what: str,
) -> tuple[torch.Tensor, float]:
    """One update of `model` over `micro_batches` through Megatron's schedule.

    `forward_step` is the schedule's forward step; the per-micro-batch figures its loss
    function reports are returned summed over micro-batches and data-parallel ranks, with the
    gradient norm before clipping. `before_update` runs just before the weights change (the
    engine waits there for background-save snapshots). An update the optimizer skips (grad
    overflow) raises, naming `what`.
    """
    model.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(int(mb["tokens"].shape[1]) for mb in micro_batches),
        micro_batch_size=int(micro_batches[0]["tokens"].shape[0]),
        forward_only=False,
    )
    summed = torch.stack(outputs).sum(dim=0)
    dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    grad_norm = optimizer.get_grad_norm() if grad_clip == 0 else 0.0
    before_update()
    ok, clip_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError(f"{what}: the optimizer skipped the update (grad overflow)")
    return summed, float(clip_norm if grad_clip > 0 else grad_norm)
