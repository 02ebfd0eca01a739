"""Advantage estimators: per-token advantages [B, T] from rewards, GRPO groups and a mask.

`rewards` is either one scalar reward per sequence [B], or token-level rewards [B, T]
(for example after `apply_kl_penalty`). Group-based estimators (grpo, rloo, opmd) score a
sequence by the masked sum of its token-level rewards; reinforce_plus_plus uses the
token-level rewards directly and places a scalar reward at the last counted token.
Every result is zero outside the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trinity_dagster.algorithm_names import AdvantageFn
from trinity_dagster.algorithms._checks import (
    bool_mask,
    check_2d,
    check_finite,
    check_mask,
    lookup,
    registry,
)

if TYPE_CHECKING:
    from trinity_dagster.config import AlgorithmConfig


@dataclass(frozen=True)
class AdvantageOptions:
    """Settings of the estimators (AlgorithmConfig: advantage_epsilon, gamma, opmd_*)."""

    epsilon: float = 1e-6
    gamma: float = 1.0
    opmd_baseline: str = "mean"
    opmd_tau: float = 1.0


def token_level_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T] rewards: each sequence's scalar reward at its last counted token, 0 elsewhere."""
    keep = bool_mask(mask)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(keep)
    last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=-1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def _sequence_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """One score per sequence: the reward itself, or the masked sum of token-level rewards."""
    if rewards.dim() == 1:
        return rewards
    return torch.where(bool_mask(mask), rewards, torch.zeros_like(rewards)).sum(dim=-1)


def _groups(group_index: Tensor) -> tuple[Tensor, Tensor, int]:
    """(dense group id per sequence, group sizes, number of groups)."""
    ids, dense = torch.unique(group_index, return_inverse=True)
    num_groups = ids.numel()
    return dense, torch.bincount(dense, minlength=num_groups), num_groups


def _group_sum(values: Tensor, dense: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, dense, values
    )


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    keep = bool_mask(mask)
    return torch.where(keep, per_seq.unsqueeze(-1).expand(keep.shape), torch.zeros(()).to(per_seq))


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, mask: Tensor, opts: AdvantageOptions
) -> Tensor:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (r_i - mean_g) / (std_g + eps).

    std_g is the unbiased (Bessel-corrected) standard deviation of the group's scores, as in
    verl and Trinity-RFT. A group of one sequence gets A = 0.
    """
    scores = _sequence_scores(rewards, mask).to(torch.float64)
    dense, sizes, num_groups = _groups(group_index)
    n = sizes.to(scores.dtype)
    mean = _group_sum(scores, dense, num_groups) / n
    centred = scores - mean[dense]
    var = _group_sum(centred.square(), dense, num_groups) / (n - 1).clamp_min(1)
    std = var.sqrt()
    adv = centred / (std[dense] + opts.epsilon)
    adv = torch.where(sizes[dense] > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv.to(rewards.dtype), mask)


def rloo_advantages(
    rewards: Tensor, group_index: Tensor, mask: Tensor, opts: AdvantageOptions
) -> Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = r_i - (sum_{j!=i} r_j) / (n - 1).

    A group of one sequence gets A = 0.
    """
    scores = _sequence_scores(rewards, mask).to(torch.float64)
    dense, sizes, num_groups = _groups(group_index)
    total = _group_sum(scores, dense, num_groups)[dense]
    n = sizes[dense].to(scores.dtype)
    adv = scores - (total - scores) / (n - 1).clamp_min(1)
    adv = torch.where(sizes[dense] > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv.to(rewards.dtype), mask)


def opmd_advantages(
    rewards: Tensor, group_index: Tensor, mask: Tensor, opts: AdvantageOptions
) -> Tensor:
    """OPMD as in Trinity-RFT (Trinity-RFT tech report, arXiv:2505.17826): A_i = r_i - b_g.

    b_g is the group mean (`opmd_baseline: mean`, Trinity's default) or
    tau * log((1/n) sum_j exp(r_j / tau)) (`opmd_baseline: logavgexp`, the soft-max baseline
    of online policy mirror descent). A group of one sequence gets A = 0 (Trinity gives it
    A = r with baseline 0; a lone sample carries no relative signal, so it is not trained).
    """
    scores = _sequence_scores(rewards, mask).to(torch.float64)
    dense, sizes, num_groups = _groups(group_index)
    n = sizes.to(scores.dtype)
    if opts.opmd_baseline == "mean":
        baseline = _group_sum(scores, dense, num_groups) / n
    elif opts.opmd_baseline == "logavgexp":
        tau = opts.opmd_tau
        if not tau > 0:
            raise ValueError(f"opmd_tau must be > 0, got {tau!r}")
        scaled = scores / tau
        peak = torch.full((num_groups,), -math.inf, dtype=scores.dtype, device=scores.device)
        peak = peak.scatter_reduce(0, dense, scaled, reduce="amax")
        sums = _group_sum(torch.exp(scaled - peak[dense]), dense, num_groups)
        baseline = tau * (peak + torch.log(sums) - torch.log(n))
    else:
        raise ValueError(f"unknown opmd_baseline {opts.opmd_baseline!r}; known: logavgexp, mean")
    adv = scores - baseline[dense]
    adv = torch.where(sizes[dense] > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv.to(rewards.dtype), mask)


def reinforce_plus_plus_advantages(
    rewards: Tensor, group_index: Tensor, mask: Tensor, opts: AdvantageOptions
) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): whitened discounted returns-to-go.

    G_t = r_t + gamma * G_next over the counted tokens of the row, G_next being the return
    at the next counted token: uncounted positions (an environment turn, padding) are not
    steps, so the return crosses them undiscounted and their rewards are dropped (as verl
    0.9.1). r are the token-level rewards (a scalar reward sits at the last counted token).
    A_t = (G_t - mu) / sqrt(var + eps), with mu and the unbiased var taken over all counted
    tokens of the batch. Groups are not used. Fewer than two counted tokens give A = 0.
    """
    keep = bool_mask(mask)
    token_rewards = (token_level_rewards(rewards, mask) if rewards.dim() == 1 else rewards).to(
        torch.float64
    )
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float64, device=rewards.device)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        stepped = token_rewards[:, t] + opts.gamma * running
        running = torch.where(keep[:, t], stepped, running)
        returns[:, t] = running
    count = int(keep.sum())
    if count < 2:
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    selected = returns[keep]
    mean = selected.mean()
    var = (selected - mean).square().sum() / (count - 1)
    adv = (returns - mean) / torch.sqrt(var + opts.epsilon)
    return torch.where(keep, adv, torch.zeros_like(adv)).to(rewards.dtype)


ADVANTAGE_FNS: dict[AdvantageFn, Callable[[Tensor, Tensor, Tensor, AdvantageOptions], Tensor]] = (
    registry(
        AdvantageFn,
        {
            "grpo": grpo_advantages,
            "rloo": rloo_advantages,
            "reinforce_plus_plus": reinforce_plus_plus_advantages,
            "opmd": opmd_advantages,
        },
    )
)


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_index: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 1e-6,
    gamma: float = 1.0,
    opmd_baseline: str = "mean",
    opmd_tau: float = 1.0,
) -> Tensor:
    """Advantages [B, T] (zero outside `mask`) of estimator `name` (a key of ADVANTAGE_FNS).

    `rewards` is [B] (one reward per sequence) or [B, T] (token-level rewards);
    `group_index` [B] is an integer group id per sequence (the GRPO group of its task).
    The result has the dtype of `rewards` (floating point) and carries no gradient.
    """
    fn = lookup(ADVANTAGE_FNS, name, "advantage_fn")
    check_mask(mask)
    batch = mask.shape[0]
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards must be a floating-point torch.Tensor")
    if rewards.dim() == 1:
        if rewards.shape[0] != batch:
            raise ValueError(f"rewards has {rewards.shape[0]} entries, mask has {batch} rows")
        check_finite("rewards", rewards)
    else:
        check_2d("rewards", rewards, mask.shape)
        check_finite("rewards", rewards, bool_mask(mask))
    if (
        not isinstance(group_index, Tensor)
        or group_index.dim() != 1
        or group_index.shape[0] != batch
        or group_index.is_floating_point()
        or group_index.dtype == torch.bool
    ):
        raise ValueError(
            f"group_index must be an integer tensor of shape [{batch}], got "
            f"{getattr(group_index, 'dtype', type(group_index).__name__)} "
            f"{tuple(getattr(group_index, 'shape', ()))}"
        )
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    opts = AdvantageOptions(
        epsilon=epsilon, gamma=gamma, opmd_baseline=opmd_baseline, opmd_tau=opmd_tau
    )
    with torch.no_grad():
        return fn(rewards.detach().to(mask.device), group_index.to(mask.device), mask, opts)


def advantages_from_config(
    algorithm: AlgorithmConfig, rewards: Tensor, group_index: Tensor, mask: Tensor
) -> Tensor:
    """Advantages [B, T] of the estimator and settings that `algorithm` (config section) selects.

    The estimator is `advantage_fn`; its options are `advantage_epsilon`, `gamma`,
    `opmd_baseline` and `opmd_tau`. Arguments and result as in `compute_advantages`.
    """
    return compute_advantages(
        algorithm.advantage_fn,
        rewards,
        group_index,
        mask,
        epsilon=algorithm.advantage_epsilon,
        gamma=algorithm.gamma,
        opmd_baseline=algorithm.opmd_baseline,
        opmd_tau=algorithm.opmd_tau,
    )
