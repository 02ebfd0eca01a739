"""Entropy of the token distributions, for the entropy bonus (AlgorithmConfig.entropy_coef)."""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H[b, t] = logsumexp(z) - sum_v softmax(z)_v z_v for logits z = logits[b, t, :].

    Logits are shifted by their maximum first (H is shift-invariant), so large logits lose no
    precision to cancellation; entries of -inf (banned tokens) contribute 0.
    Computed in float32 at least; returns [B, T] in that dtype, differentiable.
    """
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            f"logits must be a [B, T, V] tensor, got {tuple(getattr(logits, 'shape', ()))}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    z = z - z.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(z, dim=-1)
    finite_z = torch.where(torch.isneginf(z), torch.zeros_like(z), z)
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(dim=-1)
