"""The per-micro-batch math of a train step: vocab-parallel log-probs and entropy, the loss.

Logits are this tensor-parallel rank's vocabulary shard [B, T, V/tp]. Everything per token
is aligned at the token's own position: position t holds log p(token_t | tokens_<t), taken
from the logits at t-1; position 0 holds 0 (it is never a response token).

Losses are aggregated with the FULL batch's normalisers, so the pieces of a batch (micro-
batches, data-parallel ranks) sum exactly to the loss of the whole batch on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from torch import Tensor

from trinity_dagster.algorithms import aggregate_loss, kl_divergence, policy_loss

# Order of the summed per-micro-batch figures in the tensor the schedule hands back.
SUM_KEYS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "entropy",
    "pg_clipfrac_x_tokens",
    "pg_clipfrac_lower_x_tokens",
    "ppo_kl_x_tokens",
)


@dataclass(frozen=True)
class LossSettings:
    """What the loss of one step needs: algorithm choices and the full batch's normalisers."""

    policy_loss_fn: str
    clip_range_low: float
    clip_range_high: float
    dual_clip: float | None
    loss_agg_mode: str
    kl_loss_fn: str
    kl_loss_coef: float
    entropy_coef: float
    temperature: float
    max_response_len: int
    global_num_tokens: float
    global_num_seqs: float

    @property
    def uses_kl_loss(self) -> bool:
        """True when a KL-to-reference term is part of the loss."""
        return self.kl_loss_fn != "none" and self.kl_loss_coef > 0


def _shift(per_position: Tensor) -> Tensor:
    """[B, T-1] values predicted at positions 0..T-2 -> [B, T] aligned at the target token."""
    return torch.nn.functional.pad(per_position, (1, 0))


def vocab_parallel_entropy(logits: Tensor, *, grad: bool = True) -> Tensor:
    """Entropy [...] of softmax(logits) over the full vocabulary split across TP ranks.

    Without `grad` it works through the positions in chunks of about 2M logits, in place,
    so no full-size temporary is made.
    """
    logits = logits.float()
    local_max = logits.detach().amax(dim=-1)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(
            local_max,
            op=dist.ReduceOp.MAX,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    if grad:
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp, sum_exp_x = exp.sum(dim=-1), (exp * shifted).sum(dim=-1)
    else:
        sum_exp, sum_exp_x = _entropy_sums_no_grad(logits.detach(), local_max)
    sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
    sum_exp_x = reduce_from_tensor_model_parallel_region(sum_exp_x)
    return sum_exp.log() - sum_exp_x / sum_exp


@torch.no_grad()
def _entropy_sums_no_grad(logits: Tensor, row_max: Tensor) -> tuple[Tensor, Tensor]:
    """(sum_v e^(x-m), sum_v e^(x-m) (x-m)) per position, computed chunk by chunk."""
    vocab = logits.shape[-1]
    flat, flat_max = logits.reshape(-1, vocab), row_max.reshape(-1, 1)
    chunk = max(1, (1 << 21) // vocab)
    sum_exp = torch.empty(flat.shape[0], dtype=flat.dtype, device=flat.device)
    sum_exp_x = torch.empty_like(sum_exp)
    for start in range(0, flat.shape[0], chunk):
        shifted = flat[start : start + chunk] - flat_max[start : start + chunk]
        exp = shifted.exp()
        sum_exp[start : start + chunk] = exp.sum(dim=-1)
        sum_exp_x[start : start + chunk] = exp.mul_(shifted).sum(dim=-1)
    return sum_exp.view(row_max.shape), sum_exp_x.view(row_max.shape)


def token_logprobs_and_entropy(
    logits: Tensor, tokens: Tensor, *, temperature: float, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    """(log-probs [B, T], entropy [B, T]) of the tokens under softmax(logits / temperature).

    Both are aligned at the target token's position (position 0 is 0). The entropy carries a
    gradient only when `entropy_grad`.
    """
    # vocab_parallel_cross_entropy overwrites its input; the model's logits are not needed
    # by any backward (nor is `scaled` by the entropy's), so no copy is made at temperature 1.
    scaled = logits if temperature == 1.0 else logits / temperature
    targets = torch.roll(tokens, shifts=-1, dims=1)  # position t predicts token t+1
    entropy = vocab_parallel_entropy(scaled, grad=entropy_grad)
    logprobs = -vocab_parallel_cross_entropy(scaled.contiguous(), targets)
    return _shift(logprobs[:, :-1]), _shift(entropy[:, :-1])


def micro_batch_loss(
    logprobs: Tensor, entropy: Tensor, micro_batch: dict[str, Tensor], settings: LossSettings
) -> tuple[Tensor, Tensor]:
    """(loss of this piece, its summable figures in SUM_KEYS order) for one micro-batch.

    `logprobs` and `entropy` are the policy's per-token values from
    `token_logprobs_and_entropy`; `micro_batch` holds `response_mask`, `old_logprobs`,
    `advantages` and, when the loss has a KL term, `ref_logprobs` (all [b, T]). The loss is
    this piece's share of the full batch's loss; the figures are sums over the batch's pieces
    (token-weighted where the metric is a token mean).
    """
    mask = micro_batch["response_mask"]
    norm: dict[str, Any] = {
        "global_num_tokens": settings.global_num_tokens,
        "global_num_seqs": settings.global_num_seqs,
        "max_response_len": settings.max_response_len,
    }
    pg_loss, pg_metrics = policy_loss(
        settings.policy_loss_fn,
        logprobs,
        micro_batch["old_logprobs"],
        micro_batch["advantages"],
        mask,
        clip_range_low=settings.clip_range_low,
        clip_range_high=settings.clip_range_high,
        dual_clip=settings.dual_clip,
        loss_agg_mode=settings.loss_agg_mode,
        **norm,
    )
    entropy_agg = aggregate_loss(entropy, mask, settings.loss_agg_mode, **norm)
    loss = pg_loss - settings.entropy_coef * entropy_agg
    kl_loss = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if settings.uses_kl_loss:
        kl = kl_divergence(settings.kl_loss_fn, logprobs, micro_batch["ref_logprobs"])
        kl_loss = aggregate_loss(kl, mask, settings.loss_agg_mode, **norm)
        loss = loss + settings.kl_loss_coef * kl_loss
    tokens = mask.sum().to(loss.dtype)
    pieces = [
        loss.detach(),
        pg_metrics["pg_loss"],
        kl_loss.detach(),
        entropy_agg.detach(),
        pg_metrics["pg_clipfrac"] * tokens,
        pg_metrics["pg_clipfrac_lower"] * tokens,
        pg_metrics["ppo_kl"] * tokens,
    ]
    figures = torch.stack([p.to(loss.device, torch.float64) for p in pieces])
    return loss, figures


def step_metrics(summed: Tensor, global_num_tokens: float) -> dict[str, float]:
    """The actor metrics of a step from the SUM_KEYS figures summed over all pieces."""
    values = dict(zip(SUM_KEYS, summed.tolist(), strict=True))
    return {
        "actor/loss": values["loss"],
        "actor/pg_loss": values["pg_loss"],
        "actor/kl_loss": values["kl_loss"],
        "actor/entropy": values["entropy"],
        "actor/pg_clipfrac": values["pg_clipfrac_x_tokens"] / global_num_tokens,
        "actor/pg_clipfrac_lower": values["pg_clipfrac_lower_x_tokens"] / global_num_tokens,
        "actor/ppo_kl": values["ppo_kl_x_tokens"] / global_num_tokens,
    }
