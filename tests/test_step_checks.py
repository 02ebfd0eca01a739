"""The step health checks that gate weight sync."""

import math

from trinity_dagster.step_checks import kl_within_bound, loss_is_finite, sync_blockers


def test_finite_metrics_pass() -> None:
    metrics = {"actor/pg_loss": 0.1, "actor/grad_norm": 2.0, "actor/ppo_kl": 0.01}
    assert loss_is_finite(metrics)[0]
    assert kl_within_bound(metrics, bound=0.5)[0]
    assert sync_blockers(metrics, kl_bound=0.5) == []


def test_nan_loss_and_large_kl_block_the_sync() -> None:
    metrics = {"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "actor/ppo_kl": -2.0}
    ok, reason = loss_is_finite(metrics)
    assert not ok and "actor/pg_loss=nan" in reason and "actor/grad_norm=inf" in reason
    ok, reason = kl_within_bound(metrics, bound=1.0)
    assert not ok and "actor/ppo_kl=-2.0" in reason
    assert len(sync_blockers(metrics, kl_bound=1.0)) == 2


def test_missing_metrics_are_not_healthy() -> None:
    assert not loss_is_finite({})[0]
    assert not kl_within_bound({"actor/pg_loss": 0.0}, bound=1.0)[0]


def test_sft_steps_are_exempt_from_the_kl_bound() -> None:
    metrics = {"actor/pg_loss": 2.0, "actor/ppo_kl": 2.0, "actor/sft": 1.0}
    ok, reason = kl_within_bound(metrics, bound=1.0)
    assert ok and "SFT" in reason
    assert not kl_within_bound({**metrics, "actor/sft": 0.0}, bound=1.0)[0]


def test_a_critic_warmup_step_passes_on_the_critics_loss_alone() -> None:
    warmup = {"critic/vf_loss": 0.3, "critic/grad_norm": 1.0, "critic/warmup": 1.0}
    assert sync_blockers(warmup, kl_bound=1.0) == []
    ok, reason = loss_is_finite({**warmup, "critic/vf_loss": math.nan})
    assert not ok and "critic/vf_loss=nan" in reason
    assert not kl_within_bound({**warmup, "critic/warmup": 0.0}, bound=1.0)[0]
