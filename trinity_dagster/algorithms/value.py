"""PPO's critic side: GAE advantages and returns, the clipped value loss, explained variance.

Shapes as the rest of `trinity_dagster.algorithms`: [B, T] per token, `mask` marking the
response tokens that count. Values are aligned like log-probs: `values[:, t]` is the critic's
estimate of the state just before token t was generated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trinity_dagster.algorithms._checks import bool_mask, check_2d, check_finite, check_mask
from trinity_dagster.algorithms.aggregation import aggregate_loss

# verl's masked_whiten adds this to the variance before its inverse square root.
WHITEN_EPSILON = 1e-8


def gae_advantages_and_returns(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """(whitened advantages, returns) [B, T] by Generalized Advantage Estimation.

    Schulman et al. 2016 (arXiv:1506.02438), as verl's `compute_gae_advantage_return`:
    over the counted tokens of a row, delta_t = r_t + gamma V_next - V_t and
    A_t = delta_t + gamma lam A_next, where "next" is the next counted token (0 after the
    last); uncounted positions (the prompt, an environment turn, padding) are skipped.
    Returns are A + V before whitening; the advantages are then whitened over all counted
    tokens of the batch (mean 0, unbiased variance 1, epsilon `WHITEN_EPSILON`). Both are
    zero outside the mask and carry no gradient.
    """
    check_mask(mask)
    keep = bool_mask(mask)
    for label, tensor in (("token_rewards", token_rewards), ("values", values)):
        check_2d(label, tensor, mask.shape)
        check_finite(label, tensor, keep)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    with torch.no_grad():
        rewards = token_rewards.detach().to(torch.float64)
        vals = values.detach().to(torch.float64)
        advantages = torch.zeros_like(vals)
        next_value = torch.zeros(vals.shape[0], dtype=torch.float64, device=vals.device)
        next_advantage = torch.zeros_like(next_value)
        for t in range(vals.shape[1] - 1, -1, -1):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            here = delta + gamma * lam * next_advantage
            counted = keep[:, t]
            next_value = torch.where(counted, vals[:, t], next_value)
            next_advantage = torch.where(counted, here, next_advantage)
            advantages[:, t] = here
        zero = torch.zeros_like(advantages)
        returns = torch.where(keep, advantages + vals, zero)
        whitened = torch.where(keep, _whiten(advantages, keep), zero)
    return whitened.to(values.dtype), returns.to(values.dtype)


def _whiten(values: Tensor, keep: Tensor) -> Tensor:
    """(values - mean) / sqrt(var + eps), mean and unbiased var over the kept positions."""
    selected = values[keep]
    count = selected.numel()
    if count < 2:
        return torch.zeros_like(values)
    mean = selected.mean()
    var = (selected - mean).square().sum() / (count - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPSILON)


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, and detached metrics `vf_clipfrac`, `vpred_sum`.

    As verl's `compute_value_loss`: with V' = clip(vpreds, old - c, old + c),
    loss = 0.5 * agg(max((vpreds - R)^2, (V' - R)^2)); `vf_clipfrac` is the token mean of
    (V' - R)^2 > (vpreds - R)^2. Differentiable in `vpreds` only. The normalisers are
    those of `aggregate_loss` (pass the full batch's when computing a piece).
    """
    check_mask(mask)
    keep = bool_mask(mask)
    for label, tensor in (("vpreds", vpreds), ("returns", returns), ("old_values", old_values)):
        check_2d(label, tensor, mask.shape)
        check_finite(label, tensor.detach(), keep)
    if not 0 < cliprange_value < float("inf"):
        raise ValueError(f"cliprange_value must be a finite number > 0, got {cliprange_value!r}")
    returns, old_values = returns.detach(), old_values.detach()
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (vpreds - returns).square()
    clipped_loss = (clipped - returns).square()
    loss = 0.5 * aggregate_loss(
        torch.maximum(unclipped_loss, clipped_loss),
        mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )
    num_tokens = global_num_tokens if global_num_tokens is not None else max(float(keep.sum()), 1)
    hit = (clipped_loss > unclipped_loss) & keep
    metrics = {
        "vf_clipfrac": hit.sum().to(torch.float64) / num_tokens,
        "vpred_sum": vpreds.detach().to(torch.float64)[keep].sum(),
    }
    return loss, metrics


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / (Var(R) + 1e-5) over the counted tokens (verl's `vf_explained_var`).

    Variances are unbiased; fewer than two counted tokens give NaN, as torch.var does.
    """
    keep = bool_mask(mask)
    r, v = returns.detach().double()[keep], values.detach().double()[keep]
    if r.numel() < 2:
        return float("nan")
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def _check_unit(name: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
