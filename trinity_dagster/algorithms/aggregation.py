"""Loss aggregation: reduce a [B, T] tensor of per-token losses to one scalar.

Every mode divides a sum by a normaliser. When a batch is split into micro-batches (and
across data-parallel ranks), pass the FULL batch's normalisers (`mask_counts` of the full
mask, and the full `max_response_len`) to every piece: the pieces' losses then sum exactly
to the full batch's loss. Without them each piece is normalised by its own counts.

A sequence counts towards `num_seqs` when its mask has at least one non-zero entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trinity_dagster.algorithm_names import LossAggMode
from trinity_dagster.algorithms._checks import bool_mask, check_2d, check_mask, lookup, registry


@dataclass(frozen=True)
class Normalisers:
    """The denominators of the aggregation modes."""

    num_tokens: float
    num_seqs: float
    max_response_len: float


def mask_counts(mask: Tensor) -> tuple[float, float]:
    """(num_tokens, num_seqs) of `mask`: the defaults `aggregate_loss` normalises by.

    num_tokens is the sum of the mask (its count for a bool mask); num_seqs is the number
    of rows with at least one non-zero entry. Compute them on the full batch and pass them
    as `global_num_tokens` / `global_num_seqs` when aggregating its pieces.
    """
    check_mask(mask)
    weights = mask.to(torch.float64)
    return float(weights.sum()), float(bool_mask(mask).any(dim=-1).sum())


def _token_mean(masked: Tensor, weights: Tensor, norm: Normalisers) -> Tensor:
    """sum_{i,t} m_it x_it / sum_{i,t} m_it (verl/Trinity `token-mean`)."""
    return masked.sum() / norm.num_tokens


def _seq_mean_token_sum(masked: Tensor, weights: Tensor, norm: Normalisers) -> Tensor:
    """(1/N) sum_i sum_t m_it x_it (verl/Trinity `seq-mean-token-sum`)."""
    return masked.sum() / norm.num_seqs


def _seq_mean_token_mean(masked: Tensor, weights: Tensor, norm: Normalisers) -> Tensor:
    """(1/N) sum_i [sum_t m_it x_it / sum_t m_it] (verl/Trinity `seq-mean-token-mean`)."""
    per_seq_tokens = weights.sum(dim=-1)
    safe = torch.where(per_seq_tokens != 0, per_seq_tokens, torch.ones_like(per_seq_tokens))
    return (masked.sum(dim=-1) / safe).sum() / norm.num_seqs


def _seq_mean_token_sum_norm(masked: Tensor, weights: Tensor, norm: Normalisers) -> Tensor:
    """sum_{i,t} m_it x_it / (N * L_max): Dr. GRPO (Liu et al. 2025, arXiv:2503.20783)."""
    return masked.sum() / (norm.num_seqs * norm.max_response_len)


LOSS_AGG_MODES: dict[LossAggMode, Callable[[Tensor, Tensor, Normalisers], Tensor]] = registry(
    LossAggMode,
    {
        "token-mean": _token_mean,
        "seq-mean-token-sum": _seq_mean_token_sum,
        "seq-mean-token-mean": _seq_mean_token_mean,
        "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    },
)


def _resolve(name: str, given: float | None, own: float) -> float:
    """The normaliser to use: the global count when given (checked), else max(own, 1)."""
    if given is None:
        return max(own, 1.0)
    if not given > 0 or given != given or given == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {given!r}")
    if given < own - 1e-6 * max(own, 1.0):
        raise ValueError(
            f"{name} ({given}) is smaller than this piece's own count ({own}); pass the "
            "full batch's count"
        )
    return float(given)


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    max_response_len: int | None = None,
) -> Tensor:
    """Reduce per-token `values` [B, T] over the tokens selected by `mask` to a scalar.

    `mode` is a key of LOSS_AGG_MODES. Positions where the mask is zero never contribute,
    even if `values` holds NaN/inf there. A float mask weights each token. `max_response_len`
    (default T) is the Dr. GRPO constant of `seq-mean-token-sum-norm`. A piece without any
    counted token returns 0 (connected to the graph of `values`).
    """
    agg = lookup(LOSS_AGG_MODES, mode, "loss_agg_mode")
    check_mask(mask)
    check_2d("values", values, mask.shape)
    if max_response_len is not None and not (
        isinstance(max_response_len, int) and max_response_len >= 1
    ):
        raise ValueError(f"max_response_len must be an int >= 1, got {max_response_len!r}")
    own_tokens, own_seqs = mask_counts(mask)
    norm = Normalisers(
        num_tokens=_resolve("global_num_tokens", global_num_tokens, own_tokens),
        num_seqs=_resolve("global_num_seqs", global_num_seqs, own_seqs),
        max_response_len=float(max_response_len or mask.shape[-1]),
    )
    weights = mask.to(values.dtype)
    masked = torch.where(bool_mask(mask), values * weights, torch.zeros_like(values))
    return agg(masked, weights, norm)
