"""Health checks of a trained step's metrics, shared by the Dagster asset checks and the engine.

A step that fails one of them must not have its weights synced to explorers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

LOSS_METRICS = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
)
KL_METRIC = "actor/ppo_kl"
SFT_METRIC = "actor/sft"
CRITIC_WARMUP_METRIC = "critic/warmup"


def loss_is_finite(metrics: Mapping[str, float]) -> tuple[bool, str]:
    """Whether every loss-like metric of the step is a finite number."""
    bad = [name for name in LOSS_METRICS if name in metrics and not math.isfinite(metrics[name])]
    if not any(name in metrics for name in LOSS_METRICS):
        return False, f"no loss metric among {', '.join(LOSS_METRICS)}"
    if bad:
        return False, "not finite: " + ", ".join(f"{n}={metrics[n]}" for n in bad)
    return True, "all loss metrics finite"


def kl_within_bound(metrics: Mapping[str, float], bound: float) -> tuple[bool, str]:
    """Whether |actor/ppo_kl| stays within `bound` (algorithm.kl_bound).

    SFT warm-up steps pass: they imitate demonstrations, whose recorded log-probs are not
    a rollout policy, so their policy ratio measures nothing the bound is meant to catch.
    The critic's warm-up steps pass too: they do not train the actor.
    """
    if metrics.get(SFT_METRIC):
        return True, "SFT step: no rollout policy ratio to bound"
    if metrics.get(CRITIC_WARMUP_METRIC):
        return True, "critic warm-up step: the actor was not trained"
    value = metrics.get(KL_METRIC)
    if value is None:
        return False, f"{KL_METRIC} missing"
    if not math.isfinite(value) or abs(value) > bound:
        return False, f"{KL_METRIC}={value} outside [-{bound}, {bound}]"
    return True, f"{KL_METRIC}={value:.3g} within {bound}"


def sync_blockers(metrics: Mapping[str, float], kl_bound: float) -> list[str]:
    """Why weights of this step must not be synced (empty: they may be)."""
    results = (loss_is_finite(metrics), kl_within_bound(metrics, kl_bound))
    return [reason for ok, reason in results if not ok]
