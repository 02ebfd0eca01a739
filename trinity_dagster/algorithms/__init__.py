"""RL algorithms as registries of small pure torch functions, selected by AlgorithmConfig names.

Shapes: B sequences, T token positions; `mask` [B, T] (bool or float) marks the response
tokens that count. See docs/algorithms.md for each name's formula and config fields.
"""

from trinity_dagster.algorithms.advantages import (
    ADVANTAGE_FNS,
    AdvantageOptions,
    advantages_from_config,
    compute_advantages,
    token_level_rewards,
)
from trinity_dagster.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, mask_counts
from trinity_dagster.algorithms.entropy import entropy_from_logits
from trinity_dagster.algorithms.kl import KL_FNS, apply_kl_penalty, kl_divergence
from trinity_dagster.algorithms.policy_loss import POLICY_LOSS_FNS, ClipOptions, policy_loss

__all__ = [
    "ADVANTAGE_FNS",
    "KL_FNS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_FNS",
    "AdvantageOptions",
    "ClipOptions",
    "advantages_from_config",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "entropy_from_logits",
    "kl_divergence",
    "mask_counts",
    "policy_loss",
    "token_level_rewards",
]
