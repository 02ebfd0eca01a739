"""Reward functions on hand-worked cases."""

from __future__ import annotations

import pytest

from trinity_dagster.explorer.rewards import (
    REWARD_FNS,
    clean_response,
    exact_match,
    get_reward_fn,
    partial_credit,
)


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [("19<eos>", "19"), (" 19 <eos>7<eos>", "19"), ("19", "19"), ("<eos>", ""), ("4<pad>", "4")],
)
def test_clean_response_cuts_at_eos_and_strips(text: str, cleaned: str) -> None:
    assert clean_response(text) == cleaned


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("19<eos>", "19", 1.0),
        (" 19<eos>", "19", 1.0),
        ("19<eos>19", "19", 1.0),
        ("190<eos>", "19", 0.0),
        ("1<eos>9", "19", 0.0),
        ("", "19", 0.0),
        ("-4<eos>", "-4", 1.0),
        ("4<eos>", "-4", 0.0),
    ],
)
def test_exact_match(response: str, answer: str, reward: float) -> None:
    assert exact_match(response, answer) == reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("27<eos>", "27", 1.0),
        ("17<eos>", "27", 0.5),  # tens wrong, units right
        ("27<eos>", "127", 2 / 3),  # aligned at the units digit
        ("1270<eos>", "127", 0.0),  # shifted: nothing aligns
        ("<eos>", "27", 0.0),
        ("-4", "4", 0.5),
        ("abc", "xbc", 2 / 3),
    ],
)
def test_partial_credit(response: str, answer: str, reward: float) -> None:
    assert partial_credit(response, answer) == pytest.approx(reward)


def test_registry_and_unknown_name() -> None:
    assert get_reward_fn("exact_match") is exact_match
    assert get_reward_fn("partial_credit") is partial_credit
    with pytest.raises(ValueError, match=r"'bleu'.*exact_match.*partial_credit") as info:
        get_reward_fn("bleu")
    assert "explorer.reward_fn" in str(info.value)
    assert set(REWARD_FNS) == {"exact_match", "partial_credit"}
