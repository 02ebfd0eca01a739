"""Loss aggregation: hand-worked values, and exact micro-batch / data-parallel splitting."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trinity_dagster.algorithms import LOSS_AGG_MODES, aggregate_loss, mask_counts, policy_loss
from trinity_dagster.config import AlgorithmConfig

MODES = list(LOSS_AGG_MODES)
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_registry_matches_config_names() -> None:
    names = get_args(AlgorithmConfig.model_fields["loss_agg_mode"].annotation)
    assert set(LOSS_AGG_MODES) == set(names)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 4) / (2 * 3)),
    ],
)
def test_hand_worked(mode: str, expected: float) -> None:
    assert aggregate_loss(VALUES, MASK, mode).item() == pytest.approx(expected)
    # NaN/inf where the mask is off never leak in; an all-masked row is not a sequence
    values = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, -math.inf], [math.nan] * 3])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    assert aggregate_loss(values, mask, mode).item() == pytest.approx(expected)


def test_dr_grpo_constant_and_float_weights() -> None:
    loss = aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm", max_response_len=5)
    assert loss.item() == pytest.approx(7 / 10)
    weights = torch.tensor([[0.5, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(VALUES, weights, "token-mean").item() == pytest.approx(6.5 / 2.5)
    assert aggregate_loss(VALUES, weights, "seq-mean-token-mean").item() == pytest.approx(
        (2.5 / 1.5 + 4) / 2
    )


def test_mask_counts() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    assert mask_counts(mask) == (4.0, 2.0)
    assert mask_counts(mask.float() * 0.5) == (2.0, 2.0)


def test_empty_piece_gives_connected_zero() -> None:
    values = torch.ones(2, 3, requires_grad=True)
    for mode in MODES:
        loss = aggregate_loss(values, torch.zeros(2, 3), mode)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(values.grad, torch.zeros(2, 3))
        values.grad = None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; known: seq-mean"):
        aggregate_loss(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match=r"values has shape \(2, 2\), expected \(2, 3\)"):
        aggregate_loss(VALUES[:, :2], MASK, "token-mean")
    with pytest.raises(ValueError, match="global_num_tokens must be a finite number > 0"):
        aggregate_loss(VALUES, MASK, "token-mean", global_num_tokens=0)
    with pytest.raises(ValueError, match=r"global_num_seqs .* smaller than this piece"):
        aggregate_loss(VALUES, MASK, "seq-mean-token-sum", global_num_seqs=1)
    with pytest.raises(ValueError, match="max_response_len must be an int >= 1"):
        aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm", max_response_len=0)


@st.composite
def split_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A [B, T] batch with random response masks, and a random split of its rows."""
    batch = draw(st.integers(1, 7))
    width = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    starts = torch.randint(0, width, (batch,), generator=gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    pos = torch.arange(width)
    mask = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    sizes: list[int] = []
    left = batch
    while left:
        size = draw(st.integers(1, left))
        sizes.append(size)
        left -= size
    return values, mask, sizes


def _pieces(values: torch.Tensor, mask: torch.Tensor, sizes: list[int]):
    """Row pieces, each trimmed to its own last counted position (micro-batch padding)."""
    start = 0
    for size in sizes:
        piece_mask = mask[start : start + size]
        used = int(piece_mask.any(dim=0).nonzero().max()) + 1 if piece_mask.any() else 1
        yield values[start : start + size, :used], piece_mask[:, :used]
        start += size


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=40, deadline=None)
@given(case=split_batches())
def test_pieces_with_global_counts_sum_to_the_full_batch(mode: str, case) -> None:
    values, mask, sizes = case
    values = values.clone().requires_grad_(True)
    full = aggregate_loss(values, mask, mode)
    (full_grad,) = torch.autograd.grad(full, values)
    tokens, seqs = mask_counts(mask)
    if tokens == 0:
        assert full.item() == 0.0
        return
    total = torch.zeros((), dtype=torch.float64)
    for piece_values, piece_mask in _pieces(values, mask, sizes):
        total = total + aggregate_loss(
            piece_values,
            piece_mask,
            mode,
            global_num_tokens=tokens,
            global_num_seqs=seqs,
            max_response_len=mask.shape[1],
        )
    torch.testing.assert_close(total, full)
    (split_grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(split_grad, full_grad)


@pytest.mark.parametrize("name", ["ppo", "gspo", "sft"])
@settings(max_examples=20, deadline=None)
@given(case=split_batches(), mode=st.sampled_from(MODES))
def test_policy_loss_splits_exactly(name: str, case, mode: str) -> None:
    values, mask, sizes = case
    if not mask.any():
        return
    gen = torch.Generator().manual_seed(0)
    logprobs = (-values.abs()).clone().requires_grad_(True)
    old = logprobs.detach() + 0.3 * torch.randn(values.shape, generator=gen, dtype=values.dtype)
    adv = torch.randn(values.shape, generator=gen, dtype=values.dtype)
    kwargs = {"clip_range_low": 0.2, "clip_range_high": 0.28, "dual_clip": 3.0}
    tokens, seqs = mask_counts(mask)
    full, _ = policy_loss(name, logprobs, old, adv, mask, loss_agg_mode=mode, **kwargs)
    total = torch.zeros((), dtype=values.dtype)
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        piece, _ = policy_loss(
            name,
            logprobs[rows],
            old[rows],
            adv[rows],
            mask[rows],
            loss_agg_mode=mode,
            global_num_tokens=tokens,
            global_num_seqs=seqs,
            max_response_len=mask.shape[1],
            **kwargs,
        )
        total = total + piece
        start += size
    torch.testing.assert_close(total, full)
