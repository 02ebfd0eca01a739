"""Advantage estimators against hand-worked cases of their published formulas."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from trinity_dagster.algorithm_names import AdvantageFn, CriticAdvantageFn
from trinity_dagster.algorithms import (
    ADVANTAGE_FNS,
    advantages_from_config,
    compute_advantages,
    token_level_rewards,
)
from trinity_dagster.algorithms._checks import registry
from trinity_dagster.config import AlgorithmConfig, load_config

EPS = 1e-6


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_registry_matches_config_names() -> None:
    """Every advantage_fn the config accepts is in the registry, except GAE ('ppo'), which
    needs a critic's values (`algorithms.value`, called by the engine)."""
    choices = get_args(AlgorithmConfig.model_fields["advantage_fn"].annotation)
    names = {name for literal in choices for name in get_args(literal)}
    assert set(get_args(CriticAdvantageFn)) == {"ppo"}
    assert set(ADVANTAGE_FNS) == names - {"ppo"}


def test_a_registry_that_misses_or_adds_a_config_name_refuses_to_load() -> None:
    implemented = dict(ADVANTAGE_FNS)
    assert registry(AdvantageFn, implemented) is implemented
    del implemented["opmd"]
    implemented["typo"] = compute_advantages  # type: ignore[index]
    with pytest.raises(RuntimeError, match=r"missing \['opmd'\], extra \['typo'\]"):
        registry(AdvantageFn, implemented)


# Groups (interleaved, non-contiguous ids): 10 -> rewards 1, 2, 3; 3 -> 0, 1; 42 -> 7 alone.
REWARDS = torch.tensor([1.0, 0.0, 2.0, 7.0, 1.0, 3.0], dtype=torch.float64)
GROUPS = torch.tensor([10, 3, 10, 42, 3, 10])
MASK = torch.tensor(
    [
        [1, 1, 0],
        [1, 1, 1],
        [1, 0, 0],
        [1, 1, 1],
        [0, 1, 1],
        [1, 1, 1],
    ],
    dtype=torch.bool,
)


def broadcast(per_seq: list[float]) -> list[list[float]]:
    return [[a if m else 0.0 for m in row] for a, row in zip(per_seq, MASK.tolist(), strict=True)]


def test_grpo_hand_worked() -> None:
    # group 10: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # group 3: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    s3 = math.sqrt(0.5) + EPS
    expected = [-1 / (1 + EPS), -0.5 / s3, 0.0, 0.0, 0.5 / s3, 1 / (1 + EPS)]
    adv = compute_advantages("grpo", REWARDS, GROUPS, MASK, epsilon=EPS)
    close(adv, broadcast(expected))


def test_grpo_equal_rewards_give_zero_and_float32_stays_float32() -> None:
    rewards = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float32)
    adv = compute_advantages("grpo", rewards, torch.tensor([1, 1, 1]), torch.ones(3, 2))
    assert adv.dtype == torch.float32
    close(adv, [[0.0, 0.0]] * 3)


def test_rloo_hand_worked() -> None:
    # group 10: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2; group 3: 0 - 1, 1 - 0; single: 0
    expected = [-1.5, -1.0, 0.0, 0.0, 1.0, 1.5]
    close(compute_advantages("rloo", REWARDS, GROUPS, MASK), broadcast(expected))


def test_opmd_mean_baseline() -> None:
    expected = [-1.0, -0.5, 0.0, 0.0, 0.5, 1.0]
    close(compute_advantages("opmd", REWARDS, GROUPS, MASK), broadcast(expected))


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_opmd_logavgexp_baseline(tau: float) -> None:
    # rewards 0 and tau*ln3: exp(r/tau) = 1, 3 -> mean 2 -> baseline tau*ln2
    rewards = torch.tensor([0.0, tau * math.log(3)], dtype=torch.float64)
    adv = compute_advantages(
        "opmd",
        rewards,
        torch.tensor([5, 5]),
        torch.ones(2, 1),
        opmd_baseline="logavgexp",
        opmd_tau=tau,
    )
    close(adv, [[-tau * math.log(2)], [tau * math.log(3) - tau * math.log(2)]])


def test_opmd_logavgexp_is_stable_and_approaches_mean_for_large_tau() -> None:
    big = torch.tensor([1000.0, 1000.0], dtype=torch.float64)
    adv = compute_advantages(
        "opmd",
        big,
        torch.tensor([0, 0]),
        torch.ones(2, 1),
        opmd_baseline="logavgexp",
        opmd_tau=0.01,
    )
    close(adv, [[0.0], [0.0]])
    rewards = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64)
    adv = compute_advantages(
        "opmd",
        rewards,
        torch.tensor([0, 0, 0]),
        torch.ones(3, 1),
        opmd_baseline="logavgexp",
        opmd_tau=1e4,
    )
    torch.testing.assert_close(
        adv[:, 0], torch.tensor([-2.0, -1.0, 3.0], dtype=torch.float64), atol=1e-3, rtol=0
    )


def test_opmd_unknown_baseline() -> None:
    with pytest.raises(ValueError, match=r"opmd_baseline 'max'.*logavgexp, mean"):
        compute_advantages("opmd", REWARDS, GROUPS, MASK, opmd_baseline="max")


def test_token_level_rewards_places_reward_at_last_counted_token() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = token_level_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    close(out, [[0, 2, 0, 0], [0, 0, 0, 3], [0, 0, 0, 0]])


def test_reinforce_plus_plus_hand_worked() -> None:
    # gamma 0.5; row 0 reward 1 at t=2 -> returns 0.25, 0.5, 1; row 1 reward 0 -> zeros.
    # masked returns 0.25, 0.5, 1, 0, 0: mean 0.35, squared deviations sum 0.7,
    # unbiased var 0.175.
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(
        "reinforce_plus_plus", rewards, torch.tensor([0, 0]), mask, gamma=0.5, epsilon=EPS
    )
    s = math.sqrt(0.175 + EPS)
    close(adv, [[-0.1 / s, 0.15 / s, 0.65 / s], [-0.35 / s, -0.35 / s, 0.0]])


def test_reinforce_plus_plus_token_level_rewards_and_mask_gap() -> None:
    # token-level rewards with a gap in the mask (an env turn): as in verl 0.9.1 the gap is no
    # step, so the return crosses it undiscounted, and its reward (9.0) is dropped
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.5, 9.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = compute_advantages(
        "reinforce_plus_plus", rewards, torch.tensor([0, 1]), mask, gamma=0.5, epsilon=EPS
    )
    # row 0: G_2 = 1, G_0 = 0.5 + 0.5 * G_2 = 1; row 1 zeros
    # counted: 1, 1, 0, 0, 0 -> mean 0.4; deviations 0.6 x2, -0.4 x3
    var = (2 * 0.6**2 + 3 * 0.4**2) / 4
    s = math.sqrt(var + EPS)
    close(adv, [[0.6 / s, 0.0, 0.6 / s], [-0.4 / s, -0.4 / s, -0.4 / s]])


def test_reinforce_plus_plus_outcome_reward_reaches_turns_before_an_observation() -> None:
    # [action, action, observation, observation, action, action], reward 1 at the end, gamma
    # 0.5: returns 0.125, 0.25 | - - | 0.5, 1 (four steps, not six); a second row of zeros
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(
        "reinforce_plus_plus", rewards, torch.tensor([0, 1]), mask, gamma=0.5, epsilon=EPS
    )
    returns = [0.125, 0.25, 0.5, 1.0] + [0.0] * 6
    mean = sum(returns) / 10
    s = math.sqrt(sum((g - mean) ** 2 for g in returns) / 9 + EPS)
    row0 = [(0.125 - mean) / s, (0.25 - mean) / s, 0.0, 0.0, (0.5 - mean) / s, (1 - mean) / s]
    close(adv, [row0, [-mean / s] * 6])


def test_group_estimators_score_token_level_rewards_by_their_masked_sum() -> None:
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    token = torch.tensor([[0.25, 0.75], [3.0, 100.0]], dtype=torch.float64)
    # scores 1.0 and 3.0 -> rloo: 1 - 3, 3 - 1
    close(compute_advantages("rloo", token, torch.tensor([0, 0]), mask), [[-2, -2], [2, 0]])


def test_result_is_zero_outside_mask_and_has_no_grad() -> None:
    rewards = torch.tensor([1.0, 2.0], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    for name in ADVANTAGE_FNS:
        adv = compute_advantages(name, rewards, torch.tensor([0, 0]), mask)
        assert not adv.requires_grad
        assert adv[0, 0] == 0 and adv[1, 1] == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_rewards_are_named(bad: float) -> None:
    rewards = torch.tensor([1.0, bad])
    with pytest.raises(ValueError, match="rewards contains 1 NaN/inf"):
        compute_advantages("grpo", rewards, torch.tensor([0, 0]), torch.ones(2, 2))


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown advantage_fn 'gae'; known: grpo, opmd"):
        compute_advantages("gae", REWARDS, GROUPS, MASK)
    with pytest.raises(ValueError, match="rewards has 2 entries, mask has 6 rows"):
        compute_advantages("grpo", REWARDS[:2], GROUPS, MASK)
    with pytest.raises(ValueError, match="group_index must be an integer tensor of shape"):
        compute_advantages("grpo", REWARDS, GROUPS.float(), MASK)
    with pytest.raises(ValueError, match="mask must be"):
        compute_advantages("grpo", REWARDS, GROUPS, MASK[0])
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_advantages("reinforce_plus_plus", REWARDS, GROUPS, MASK, gamma=1.5)


def config_advantages(overrides: dict, rewards: torch.Tensor = REWARDS) -> torch.Tensor:
    """The advantages the engine computes for a config loaded with `overrides` (dotted keys)."""
    algorithm = load_config(None, overrides=overrides).algorithm
    return advantages_from_config(algorithm, rewards, GROUPS, MASK)


def test_config_gamma_changes_the_advantages() -> None:
    rpp = {"algorithm.algorithm_type": "reinforce_plus_plus"}
    discounted = config_advantages({**rpp, "algorithm.gamma": 0.9})
    expected = compute_advantages("reinforce_plus_plus", REWARDS, GROUPS, MASK, gamma=0.9)
    torch.testing.assert_close(discounted, expected)
    assert not torch.allclose(discounted, config_advantages({**rpp, "algorithm.gamma": 1.0}))


def test_config_opmd_baseline_and_tau_change_the_advantages() -> None:
    opmd = {"algorithm.algorithm_type": "opmd"}
    soft = {**opmd, "algorithm.opmd_baseline": "logavgexp", "algorithm.opmd_tau": 0.5}
    expected = compute_advantages(
        "opmd", REWARDS, GROUPS, MASK, opmd_baseline="logavgexp", opmd_tau=0.5
    )
    torch.testing.assert_close(config_advantages(soft), expected)
    assert not torch.allclose(config_advantages(soft), config_advantages(opmd))
    hotter = {**soft, "algorithm.opmd_tau": 2.0}
    assert not torch.allclose(config_advantages(soft), config_advantages(hotter))


def test_config_advantage_epsilon_changes_the_advantages() -> None:
    coarse = config_advantages({"algorithm.advantage_epsilon": 0.5})
    expected = compute_advantages("grpo", REWARDS, GROUPS, MASK, epsilon=0.5)
    torch.testing.assert_close(coarse, expected)
    assert not torch.allclose(coarse, config_advantages({}))
