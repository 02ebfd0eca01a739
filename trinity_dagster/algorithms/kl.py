"""KL estimators between the policy and a reference model, per token, and the KL reward penalty.

With log-ratio d = logp - ref (per token, sampled from the policy), the estimators of
KL(pi || pi_ref) are those of Schulman, "Approximating KL Divergence" (2020), as named in
Trinity-RFT. verl differs in one name: its `k3` is the clamped `low_var_kl`; here `k3` is
the plain formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trinity_dagster.algorithm_names import KlFn
from trinity_dagster.algorithms._checks import (
    bool_mask,
    check_2d,
    check_finite,
    check_mask,
    lookup,
    registry,
)
from trinity_dagster.algorithms.advantages import token_level_rewards


def _none(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """0: no KL term."""
    return torch.zeros_like(logprobs)


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logp - ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (logp - ref)^2 / 2 (biased, low variance)."""
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, >= 0), unclamped."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def _low_var_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10] (verl)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


def _abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|logp - ref|."""
    return (logprobs - ref_logprobs).abs()


KL_FNS: dict[KlFn, Callable[[Tensor, Tensor], Tensor]] = registry(
    KlFn,
    {
        "none": _none,
        "k1": _k1,
        "k2": _k2,
        "k3": _k3,
        "low_var_kl": _low_var_kl,
        "abs": _abs,
    },
)


def kl_divergence(name: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The elementwise KL estimate [B, T] of estimator `name` (a key of KL_FNS).

    Differentiable in `logprobs` (use it as a loss term: `aggregate_loss(kl, mask, mode)`).
    """
    fn = lookup(KL_FNS, name, "kl_fn")
    check_2d("logprobs", logprobs)
    check_2d("ref_logprobs", ref_logprobs, logprobs.shape)
    return fn(logprobs, ref_logprobs)


def apply_kl_penalty(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    name: str,
    coef: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level rewards [B, T] with a KL penalty: r_t - coef * kl_t on counted tokens.

    `rewards` is [B] (placed at each sequence's last counted token, as
    `token_level_rewards` does) or already token-level [B, T]. `logprobs` are the rollout
    policy's (old) log-probs, `ref_logprobs` the reference model's. Positions outside the
    mask are 0. Feed the result to `compute_advantages` (reinforce_plus_plus uses it per
    token; group estimators score a sequence by its sum), as in verl / Trinity-RFT
    `apply_kl_penalty_to_reward`. Metrics (detached scalars): `kl` = mean, over the
    sequences with at least one counted token, of each one's mean KL over its counted
    tokens (0 when there is none; Trinity counts an empty sequence as 0 in the mean),
    `kl_coef` = coef.
    """
    fn = lookup(KL_FNS, name, "kl_penalty_fn")
    check_mask(mask)
    keep = bool_mask(mask)
    check_2d("logprobs", logprobs, mask.shape)
    check_2d("ref_logprobs", ref_logprobs, mask.shape)
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards must be a floating-point torch.Tensor")
    rewards = rewards.to(mask.device)
    if rewards.dim() == 1:
        if rewards.shape[0] != mask.shape[0]:
            raise ValueError(
                f"rewards has {rewards.shape[0]} entries, mask has {mask.shape[0]} rows"
            )
        check_finite("rewards", rewards)
        token_rewards = token_level_rewards(rewards, mask)
    else:
        check_2d("rewards", rewards, mask.shape)
        check_finite("rewards", rewards, keep)
        token_rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    if not (coef >= 0 and coef < float("inf")):
        raise ValueError(f"coef must be a finite number >= 0, got {coef!r}")
    check_finite("logprobs", logprobs, keep)
    check_finite("ref_logprobs", ref_logprobs, keep)
    with torch.no_grad():
        kl = fn(logprobs.detach(), ref_logprobs.detach()).to(token_rewards.dtype)
        kl = torch.where(keep, kl, torch.zeros_like(kl))
        penalised = token_rewards - coef * kl
        per_seq_tokens = keep.sum(dim=-1).clamp_min(1).to(kl.dtype)
        seq_kl = kl.sum(dim=-1) / per_seq_tokens
        has_tokens = keep.any(dim=-1)
        mean_kl = seq_kl[has_tokens].mean() if bool(has_tokens.any()) else kl.new_zeros(())
    metrics = {"kl": mean_kl, "kl_coef": mean_kl.new_tensor(float(coef))}
    return penalised, metrics
