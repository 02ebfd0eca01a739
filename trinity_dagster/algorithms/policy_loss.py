"""Policy losses: per-token surrogate losses, aggregated by a loss_agg_mode to one scalar.

Each registered function maps (logprobs, old_logprobs, advantages, mask, options) to
per-token losses [B, T] and detached scalar metrics; `policy_loss` aggregates the losses
with `aggregate_loss` and adds the metric `pg_loss`. Metrics other than `pg_loss` are
means over this piece's counted tokens (or sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trinity_dagster.algorithm_names import PolicyLossFn
from trinity_dagster.algorithms._checks import (
    bool_mask,
    check_2d,
    check_finite,
    check_mask,
    lookup,
    registry,
)
from trinity_dagster.algorithms.aggregation import aggregate_loss

# Log-ratios are clamped to this range before exp, for stability (as in Trinity-RFT / verl).
LOG_RATIO_LIMIT = 20.0
# GSPO's sequence log-ratio is capped here before exp, as in verl: above it the ratio is
# e^10 and the sequence contributes no gradient.
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class ClipOptions:
    """Clipping of the importance ratio: [1 - low, 1 + high], and the dual-clip constant."""

    clip_range_low: float
    clip_range_high: float
    dual_clip: float | None


def _masked_mean(values: Tensor, keep: Tensor) -> Tensor:
    count = keep.sum().clamp_min(1)
    return torch.where(keep, values, torch.zeros_like(values)).sum() / count


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, keep: Tensor, opts: ClipOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO-clip loss max(-A r, -A clip(r, 1-low, 1+high)), dual-clipped for A < 0.

    PPO: Schulman et al. 2017 (arXiv:1707.06347); separate low/high ranges ("clip-higher"):
    DAPO, Yu et al. 2025 (arXiv:2503.14476); dual clip: Ye et al. 2020 (arXiv:1912.09729),
    for A < 0 the loss is min(that, -c A).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - opts.clip_range_low, 1.0 + opts.clip_range_high)
    losses = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": _masked_mean((clipped > unclipped).to(ratio.dtype), keep)}
    if opts.dual_clip is None:
        metrics["pg_clipfrac_lower"] = ratio.new_zeros(())
        return losses, metrics
    cap = -advantages * opts.dual_clip
    negative = advantages < 0
    metrics["pg_clipfrac_lower"] = _masked_mean(((losses > cap) & negative).to(ratio.dtype), keep)
    losses = torch.where(negative, torch.minimum(losses, cap), losses)
    return losses, metrics


def ppo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, keep: Tensor, opts: ClipOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO-clip with r_t = exp(logp_t - old_t); see `_clipped_surrogate`."""
    log_ratio = torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    losses, metrics = _clipped_surrogate(torch.exp(log_ratio), advantages, keep, opts)
    metrics["ppo_kl"] = _masked_mean(-log_ratio.detach(), keep)
    return losses, metrics


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, keep: Tensor, opts: ClipOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), in its GSPO-token form.

    s_i = exp((1/|y_i|) sum_t (logp_t - old_t)) is the sequence's importance ratio. Token t
    uses s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) (value s_i, gradient s_i * grad logp_t)
    in the clipped surrogate with A_t, so the clip decision is per sequence. With
    advantages constant over a sequence and `seq-mean-token-mean` aggregation this is
    exactly the GSPO objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) and its gradient.
    As in verl, log s_i,t is capped at GSPO_LOG_RATIO_MAX: a sequence whose ratio is above
    e^10 counts with ratio e^10 and no gradient.
    """
    token_log_ratio = torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs))
    tokens = keep.sum(dim=-1).clamp_min(1).to(logprobs.dtype)
    seq_log_ratio = token_log_ratio.sum(dim=-1) / tokens
    live = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    log_ratio = live - live.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    losses, metrics = _clipped_surrogate(ratio, advantages, keep, opts)
    metrics["ppo_kl"] = _masked_mean(-token_log_ratio.detach(), keep)
    has_tokens = keep.any(dim=-1)
    metrics["ppo_kl_seq"] = _masked_mean(-seq_log_ratio.detach(), has_tokens)
    return losses, metrics


def sft_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, keep: Tensor, opts: ClipOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood -logp_t of the response tokens; advantages and clipping unused."""
    log_ratio = torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs))
    zero = logprobs.new_zeros(())
    metrics = {
        "pg_clipfrac": zero,
        "pg_clipfrac_lower": zero,
        "ppo_kl": _masked_mean(-log_ratio.detach(), keep),
    }
    return -logprobs, metrics


POLICY_LOSS_FNS: dict[
    PolicyLossFn,
    Callable[[Tensor, Tensor, Tensor, Tensor, ClipOptions], tuple[Tensor, dict[str, Tensor]]],
] = registry(
    PolicyLossFn,
    {
        "ppo": ppo_loss,
        "gspo": gspo_loss,
        "sft": sft_loss,
    },
)


def _check_clip(clip_range_low: float, clip_range_high: float, dual_clip: float | None) -> None:
    if not 0 <= clip_range_low < 1:
        raise ValueError(f"clip_range_low must be in [0, 1), got {clip_range_low!r}")
    if not 0 <= clip_range_high < float("inf"):
        raise ValueError(f"clip_range_high must be a finite number >= 0, got {clip_range_high!r}")
    if dual_clip is not None and not 1 < dual_clip < float("inf"):
        raise ValueError(f"dual_clip must be None or a finite number > 1, got {dual_clip!r}")


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_range_low: float,
    clip_range_high: float,
    dual_clip: float | None,
    loss_agg_mode: str,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss `name` (a key of POLICY_LOSS_FNS) as a scalar, and detached metrics.

    All tensors are [B, T]; only positions where `mask` is non-zero count. The loss is
    differentiable in `logprobs` only. Metrics: `pg_loss`, `pg_clipfrac`,
    `pg_clipfrac_lower`, `ppo_kl` (mean of old - logp), and `ppo_kl_seq` for gspo.
    `global_num_tokens`, `global_num_seqs`, `max_response_len`: see `aggregate_loss`.
    """
    fn = lookup(POLICY_LOSS_FNS, name, "policy_loss_fn")
    _check_clip(clip_range_low, clip_range_high, dual_clip)
    check_mask(mask)
    keep = bool_mask(mask)
    for label, tensor in (
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
    ):
        check_2d(label, tensor, mask.shape)
        check_finite(label, tensor.detach(), keep)
    opts = ClipOptions(clip_range_low, clip_range_high, dual_clip)
    losses, metrics = fn(logprobs, old_logprobs.detach(), advantages.detach(), keep, opts)
    loss = aggregate_loss(
        losses,
        mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )
    metrics = {key: value.detach() for key, value in metrics.items()}
    metrics["pg_loss"] = loss.detach()
    return loss, metrics
