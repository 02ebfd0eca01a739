"""Policy losses (ppo, gspo, sft) against hand-worked values and gradients."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from trinity_dagster.algorithms import POLICY_LOSS_FNS, aggregate_loss, policy_loss
from trinity_dagster.config import AlgorithmConfig

CLIP = {"clip_range_low": 0.2, "clip_range_high": 0.28}

# one row, six tokens, old logprobs 0, so ratio r = exp(logp)
RATIOS = [1.5, 0.5, 0.5, 1.5, 5.0, 1.1]
ADVS = [1.0, 1.0, -1.0, -1.0, -1.0, 2.0]
# per-token loss max(-A r, -A clip(r, 0.8, 1.28)):
#   -1.28 (clipped), -0.5, 0.8 (clipped), 1.5, 5.0 (3.0 with dual clip c=3), -2.2
LOSSES = [-1.28, -0.5, 0.8, 1.5, 5.0, -2.2]
# d loss / d logp_t = -A r for unclipped tokens, 0 for clipped ones (divided by 6 tokens)
GRADS = [0.0, -0.5 / 6, 0.0, 1.5 / 6, 5.0 / 6, -2.2 / 6]


def ppo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[math.log(r) for r in RATIOS]], dtype=torch.float64, requires_grad=True)
    return logp, torch.zeros(1, 6, dtype=torch.float64), torch.tensor([ADVS]), torch.ones(1, 6)


def test_registry_matches_config_names() -> None:
    names = get_args(AlgorithmConfig.model_fields["policy_loss_fn"].annotation)
    assert set(POLICY_LOSS_FNS) == set(names)


def test_ppo_clip_higher_values_metrics_and_gradients() -> None:
    logp, old, adv, mask = ppo_inputs()
    loss, metrics = policy_loss(
        "ppo", logp, old, adv.double(), mask, dual_clip=None, loss_agg_mode="token-mean", **CLIP
    )
    assert loss.item() == pytest.approx(sum(LOSSES) / 6)
    assert metrics["pg_loss"].item() == pytest.approx(sum(LOSSES) / 6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 6)  # tokens 1 and 3
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6)
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([GRADS], dtype=torch.float64))


def test_ppo_dual_clip_caps_negative_advantage_loss() -> None:
    logp, old, adv, mask = ppo_inputs()
    loss, metrics = policy_loss(
        "ppo", logp, old, adv.double(), mask, dual_clip=3.0, loss_agg_mode="token-mean", **CLIP
    )
    capped = [*LOSSES[:4], 3.0, LOSSES[5]]  # token 5: min(5, -A * 3) = 3
    assert loss.item() == pytest.approx(sum(capped) / 6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    loss.backward()
    expected = [*GRADS[:4], 0.0, GRADS[5]]
    torch.testing.assert_close(logp.grad, torch.tensor([expected], dtype=torch.float64))


def test_ppo_on_policy_gradient_is_the_policy_gradient() -> None:
    # at ratio 1 nothing is clipped: grad = -A / N per token (REINFORCE with advantages)
    logp = torch.tensor([[-0.7, -1.2, -3.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -2.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = policy_loss(
        "ppo", logp, logp.detach(), adv, mask, dual_clip=2.0, loss_agg_mode="token-mean", **CLIP
    )
    assert loss.item() == pytest.approx((-0.5 + 2.0) / 2)
    assert metrics["ppo_kl"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 1.0, 0.0]]))


def test_gspo_sequence_ratio_hand_worked() -> None:
    # row 0: log-ratios ln2, 0 -> s = exp(ln2 / 2) = sqrt2 > 1.28, A = 1: loss -1.28, clipped
    # row 1: log-ratios ln1.1, ln0.9 (third token masked) -> s = sqrt(0.99), A = -1: loss s
    logp = torch.tensor(
        [[math.log(2), 0.0, -1.0], [math.log(1.1), math.log(0.9), math.nan]],
        dtype=torch.float64,
        requires_grad=True,
    )
    old = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    loss, metrics = policy_loss(
        "gspo", logp, old, adv, mask, dual_clip=None, loss_agg_mode="seq-mean-token-mean", **CLIP
    )
    s1 = math.sqrt(0.99)
    assert loss.item() == pytest.approx((-1.28 + s1) / 2)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["ppo_kl_seq"].item() == pytest.approx(
        -(math.log(2) / 2 + math.log(0.99) / 2) / 2
    )
    loss.backward()
    # row 1: d/dlogp_t of (1/2) * (-A) * s with ds/dlogp_t = s / 2 -> s / 4
    expected = [[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=torch.float64))


def test_gspo_matches_the_paper_objective_and_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    logp = (-torch.rand(4, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.2 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool
    )
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    adv = seq_adv[:, None].expand(4, 5)
    loss, _ = policy_loss(
        "gspo", logp, old, adv, mask, dual_clip=None, loss_agg_mode="seq-mean-token-mean", **CLIP
    )
    (grad,) = torch.autograd.grad(loss, logp)
    # the paper: J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i),
    # s_i = exp(mean over the sequence's tokens of logp - old)
    m = mask.double()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    objective = torch.minimum(s * seq_adv, s.clamp(0.8, 1.28) * seq_adv).mean()
    (ref_grad,) = torch.autograd.grad(-objective, logp)
    torch.testing.assert_close(loss, -objective)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize(
    ("seq_log_ratio", "ratio", "token_grad"),
    [(9.0, math.exp(9.0), math.exp(9.0) / 2), (11.0, math.exp(10.0), 0.0)],
)
def test_gspo_caps_the_sequence_ratio_at_e10_like_verl(
    seq_log_ratio: float, ratio: float, token_grad: float
) -> None:
    # A < 0 keeps the unclipped side: loss = mean over the 2 tokens of -A * s. Above the cap
    # the ratio is e^10 and the sequence gives no gradient (no full-size step on a stale row).
    logp = torch.full((1, 2), seq_log_ratio, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.full((1, 2), -1.0, dtype=torch.float64)
    loss, _ = policy_loss(
        "gspo",
        logp,
        old,
        adv,
        torch.ones(1, 2),
        dual_clip=None,
        loss_agg_mode="seq-mean-token-mean",
        **CLIP,
    )
    assert loss.item() == pytest.approx(ratio)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), token_grad, dtype=torch.float64))


def test_sft_is_masked_negative_log_likelihood() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.full((2, 3), 123.0)
    loss, metrics = policy_loss(
        "sft", logp, logp.detach(), adv, mask, dual_clip=None, loss_agg_mode="token-mean", **CLIP
    )
    assert loss.item() == pytest.approx((1 + 2 + 0.5) / 3)
    assert metrics["pg_clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3, 0], [-1 / 3, 0, 0]]))


def test_policy_loss_aggregates_with_the_requested_mode() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(
        "sft",
        logp,
        logp,
        torch.zeros(2, 3),
        mask,
        dual_clip=None,
        loss_agg_mode="seq-mean-token-sum",
        **CLIP,
    )
    assert loss.item() == pytest.approx(((1 + 2) + 0.5) / 2)
    assert loss.item() == pytest.approx(aggregate_loss(-logp, mask, "seq-mean-token-sum").item())


def test_garbage_outside_the_mask_is_ignored() -> None:
    logp = torch.tensor([[-1.0, math.nan]], requires_grad=True)
    old = torch.tensor([[-1.0, math.inf]])
    adv = torch.tensor([[2.0, math.nan]])
    mask = torch.tensor([[True, False]])
    for name in POLICY_LOSS_FNS:
        loss, metrics = policy_loss(
            name, logp, old, adv, mask, dual_clip=3.0, loss_agg_mode="token-mean", **CLIP
        )
        assert all(math.isfinite(value.item()) for value in metrics.values())
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


def test_bad_inputs_raise_clear_errors() -> None:
    logp, old, adv, mask = ppo_inputs()
    kwargs = {"dual_clip": None, "loss_agg_mode": "token-mean", **CLIP}
    with pytest.raises(ValueError, match="unknown policy_loss_fn 'dpo'; known: gspo, ppo, sft"):
        policy_loss("dpo", logp, old, adv, mask, **kwargs)
    bad = adv.clone()
    bad[0, 2] = math.nan
    with pytest.raises(ValueError, match=r"advantages contains 1 NaN/inf value.*masked positions"):
        policy_loss("ppo", logp, old, bad, mask, **kwargs)
    with pytest.raises(ValueError, match="old_logprobs contains"):
        policy_loss("ppo", logp, old + math.inf, adv, mask, **kwargs)
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 5\), expected \(1, 6\)"):
        policy_loss("ppo", logp, old, adv[:, :5], mask, **kwargs)
    with pytest.raises(ValueError, match="dual_clip must be None or a finite number > 1"):
        policy_loss("ppo", logp, old, adv, mask, **{**kwargs, "dual_clip": 0.5})
    with pytest.raises(ValueError, match=r"clip_range_low must be in \[0, 1\)"):
        policy_loss("ppo", logp, old, adv, mask, **{**kwargs, "clip_range_low": 1.0})
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        policy_loss("ppo", logp, old, adv, mask, **{**kwargs, "loss_agg_mode": "sum"})
