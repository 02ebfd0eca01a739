"""KL estimators, the KL reward penalty and the entropy of logits, against hand-worked values."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from trinity_dagster.algorithms import (
    KL_FNS,
    apply_kl_penalty,
    compute_advantages,
    entropy_from_logits,
    kl_divergence,
)
from trinity_dagster.config import AlgorithmConfig

LOGP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
# d = logp - ref = 0.5, -1.0; ref - logp = -0.5, 1.0
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]


def test_registry_matches_config_names() -> None:
    for field in ("kl_loss_fn", "kl_penalty_fn"):
        names = get_args(AlgorithmConfig.model_fields[field].annotation)
        assert set(KL_FNS) == set(names)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("none", [0.0, 0.0]),
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        ("k3", K3),
        ("low_var_kl", K3),
        ("abs", [0.5, 1.0]),
    ],
)
def test_estimators_hand_worked(name: str, expected: list[float]) -> None:
    out = kl_divergence(name, LOGP, REF)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=torch.float64))


def test_low_var_kl_is_clamped_like_verl() -> None:
    logp = torch.tensor([[-30.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -30.0]], dtype=torch.float64)
    # ref - logp = 30 -> clamped to 20 -> exp(20) - 21 -> 10; -30 -> -20 -> 19 + e^-20 -> 10
    torch.testing.assert_close(
        kl_divergence("low_var_kl", logp, ref), torch.tensor([[10.0, 10.0]], dtype=torch.float64)
    )
    assert kl_divergence("k3", logp, ref)[0, 0].item() == pytest.approx(math.exp(30) - 31)


def test_k3_gradient() -> None:
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    logp = LOGP.clone().requires_grad_(True)
    kl_divergence("k3", logp, REF).sum().backward()
    expected = [1 - math.exp(-0.5), 1 - math.exp(1.0)]
    torch.testing.assert_close(logp.grad, torch.tensor([expected], dtype=torch.float64))


def test_unknown_and_mismatched() -> None:
    with pytest.raises(ValueError, match="unknown kl_fn 'k4'; known: abs, k1, k2, k3"):
        kl_divergence("k4", LOGP, REF)
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(1, 1\)"):
        kl_divergence("k1", LOGP, REF[:, :1])


def test_apply_kl_penalty_hand_worked() -> None:
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, math.nan, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    out, metrics = apply_kl_penalty(rewards, logp, ref, mask, "k1", 0.1)
    # k1 per counted token: 0.5, -1.0 | 0.5; reward at the last counted token
    expected = [[-0.05, 1.0 + 0.1, 0.0], [-0.05, 0.0, 0.0]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    # per-sequence mean KL: (0.5 - 1.0) / 2 and 0.5 -> batch mean 0.125
    assert metrics["kl"].item() == pytest.approx(0.125)
    assert metrics["kl_coef"].item() == pytest.approx(0.1)


def test_kl_penalised_rewards_feed_reinforce_plus_plus() -> None:
    mask = torch.tensor([[1, 1], [1, 1]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    token, _ = apply_kl_penalty(rewards, logp, ref, mask, "k1", 0.5)
    torch.testing.assert_close(token, torch.tensor([[-0.5, 1.0], [0.0, 0.0]], dtype=torch.float64))
    adv = compute_advantages("reinforce_plus_plus", token, torch.tensor([0, 1]), mask, gamma=1.0)
    # returns-to-go: 0.5, 1.0, 0, 0 -> mean 0.375, unbiased var (0.125^2 + 0.625^2 + 2 * 0.375^2)/3
    var = (0.125**2 + 0.625**2 + 2 * 0.375**2) / 3
    s = math.sqrt(var + 1e-6)
    expected = [[0.125 / s, 0.625 / s], [-0.375 / s, -0.375 / s]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_apply_kl_penalty_errors() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown kl_penalty_fn 'kl'"):
        apply_kl_penalty(torch.tensor([1.0]), LOGP, REF, mask, "kl", 0.1)
    with pytest.raises(ValueError, match="rewards contains 1 NaN/inf"):
        apply_kl_penalty(torch.tensor([math.nan]), LOGP, REF, mask, "k1", 0.1)
    with pytest.raises(ValueError, match="ref_logprobs contains 1 NaN/inf"):
        apply_kl_penalty(
            torch.tensor([1.0]), LOGP, REF + torch.tensor([[0, math.inf]]), mask, "k1", 0.1
        )
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        apply_kl_penalty(torch.tensor([1.0]), LOGP, REF, mask, "k1", -1.0)


def test_entropy_hand_worked() -> None:
    p = [0.25, 0.75]
    h = -sum(q * math.log(q) for q in p)
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -math.inf, -math.inf]],
            [[1000.0, 1000.0 + math.log(3), -math.inf, -math.inf], [5.0, 5.0, -math.inf, 5.0]],
        ],
        requires_grad=True,
    )
    out = entropy_from_logits(logits)
    expected = [[math.log(4), h], [h, math.log(3)]]
    torch.testing.assert_close(out, torch.tensor(expected))
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_categorical_and_upcasts_bf16() -> None:
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)) * 5
    reference = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), reference)
    out = entropy_from_logits(logits.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match=r"logits must be a \[B, T, V\] tensor"):
        entropy_from_logits(logits[0])
