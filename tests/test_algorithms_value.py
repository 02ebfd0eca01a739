"""GAE, the clipped value loss and explained variance against numbers worked out by hand and
against the closed forms of the papers (not the recursion the code uses)."""

from __future__ import annotations

import pytest
import torch

from trinity_dagster.algorithms.value import (
    WHITEN_EPSILON,
    explained_variance,
    gae_advantages_and_returns,
    value_loss,
)


def closed_form_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw advantages and returns: A_k = sum_l (gamma lam)^l delta_{k+l} over a row's counted
    tokens, delta_k = r_k + gamma V_{k+1} - V_k with V after the last counted token 0."""
    adv = torch.zeros_like(values, dtype=torch.float64)
    for row in range(values.shape[0]):
        idx = [int(i) for i in torch.nonzero(mask[row]).flatten()]
        r = [float(rewards[row, i]) for i in idx]
        v = [float(values[row, i]) for i in idx] + [0.0]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(idx))]
        for k, i in enumerate(idx):
            adv[row, i] = sum((gamma * lam) ** j * d for j, d in enumerate(deltas[k:]))
    returns = torch.where(mask, adv + values.double(), torch.zeros_like(adv))
    return adv, returns


def whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    sel = adv[mask]
    out = (adv - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + WHITEN_EPSILON)
    return torch.where(mask, out, torch.zeros_like(out))


def test_gae_of_one_row_worked_by_hand():
    # prompt at position 0, response tokens 1..3; reward 1 on the last token.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4]])  # the prompt's value is never used
    mask = torch.tensor([[False, True, True, True]])
    _, returns = gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta_3 = 1 - 0.4 = 0.6;            A_3 = 0.6
    # delta_2 = 0.9*0.4 - 0.2 = 0.16;     A_2 = 0.16 + 0.72*0.6 = 0.592
    # delta_1 = 0.9*0.2 - 0.5 = -0.32;    A_1 = -0.32 + 0.72*0.592 = 0.10624
    # returns = A + V: 0.60624, 0.792, 1.0
    expected = torch.tensor([[0.0, 0.60624, 0.792, 1.0]])
    assert torch.allclose(returns.double(), expected.double(), atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_the_closed_form_with_gaps_and_padding(gamma: float, lam: float):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    mask = torch.zeros(5, 12, dtype=torch.bool)
    mask[0, 3:9] = True
    mask[1, 2:4] = True
    mask[1, 6:11] = True  # a second turn after an uncounted environment turn
    mask[2, 5] = True
    mask[3, 4:12] = True
    mask[4, 1:7] = True
    rewards[~mask] = 123.0  # rewards outside the mask are dropped
    adv, returns = gae_advantages_and_returns(rewards, values, mask, gamma=gamma, lam=lam)
    raw, expected_returns = closed_form_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(returns, expected_returns, atol=1e-6, rtol=0)
    assert torch.allclose(adv, whiten(raw, mask), atol=1e-6, rtol=0)
    assert float(adv[mask].mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(adv[mask].std()) == pytest.approx(1.0, abs=1e-6)
    assert not adv[~mask].any() and not returns[~mask].any()


def test_gae_refuses_bad_input():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="values contains 1 NaN"):
        gae_advantages_and_returns(
            torch.zeros(2, 3), torch.tensor([[0.0, float("nan"), 0], [0, 0, 0]]), mask,
            gamma=1.0, lam=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="lam must be in"):
        gae_advantages_and_returns(torch.zeros(2, 3), torch.zeros(2, 3), mask, gamma=1, lam=2)
    with pytest.raises(ValueError, match="values has shape"):
        gae_advantages_and_returns(torch.zeros(2, 3), torch.zeros(2, 4), mask, gamma=1, lam=1)


def test_value_loss_worked_by_hand():
    vpreds = torch.tensor([[0.0, 1.0, 2.0, 0.3]], requires_grad=True)
    returns = torch.tensor([[0.0, 1.5, 0.0, 0.2]])
    old = torch.tensor([[0.0, 0.2, 1.0, 0.3]])
    mask = torch.tensor([[False, True, True, True]])
    loss, metrics = value_loss(
        vpreds, returns, old, mask, cliprange_value=0.5, loss_agg_mode="token-mean"
    )
    # token 1: clipped 0.7; (1-1.5)^2 = 0.25, (0.7-1.5)^2 = 0.64 -> 0.64 (clipped wins)
    # token 2: clipped 1.5; (2-0)^2 = 4, (1.5-0)^2 = 2.25 -> 4
    # token 3: clipped 0.3; both 0.01 -> 0.01
    # loss = 0.5 * (0.64 + 4 + 0.01) / 3
    assert float(loss.detach()) == pytest.approx(0.5 * 4.65 / 3, abs=1e-6)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(1 / 3, abs=1e-9)
    assert float(metrics["vpred_sum"]) == pytest.approx(3.3, abs=1e-6)
    loss.backward()
    # d/dv of 0.5*(v-R)^2/3 where the unclipped term wins; 0 where the clipped one does
    expected_grad = torch.tensor([[0.0, 0.0, 2.0 / 3, 0.1 / 3]])
    assert torch.allclose(vpreds.grad, expected_grad, atol=1e-6)


def test_value_loss_pieces_sum_to_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    vpreds, returns, old = (torch.randn(6, 7, generator=gen) for _ in range(3))
    mask = torch.rand(6, 7, generator=gen) > 0.3
    whole, whole_m = value_loss(
        vpreds, returns, old, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-mean"
    )
    tokens, seqs = float(mask.sum()), float(mask.any(1).sum())
    parts = [
        value_loss(
            vpreds[i : i + 2], returns[i : i + 2], old[i : i + 2], mask[i : i + 2],
            cliprange_value=0.2, loss_agg_mode="seq-mean-token-mean",
            global_num_tokens=tokens, global_num_seqs=seqs,
        )
        for i in range(0, 6, 2)
    ]  # fmt: skip
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-6)
    clipfrac = sum(float(p[1]["vf_clipfrac"]) for p in parts)
    assert clipfrac == pytest.approx(float(whole_m["vf_clipfrac"]), abs=1e-9)


def test_explained_variance():
    mask = torch.tensor([[True, True, True, False]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-5)
    # R - V = [1, 1, 1]: no variance left; V = 0: none explained
    assert explained_variance(returns, returns - 1, mask) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(returns, torch.zeros(1, 4), mask) == pytest.approx(0.0, abs=1e-5)
