"""Reward functions on hand-worked cases."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.config import load_config
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.explorer.rewards import (
    REWARD_FNS,
    clean_response,
    exact_match,
    get_reward_fn,
    math_verify,
    partial_credit,
)
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import load_taskset

REPO = Path(__file__).resolve().parents[1]


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
    with pytest.raises(
        ValueError, match=r"'bleu'.*exact_match.*math_verify.*partial_credit"
    ) as info:
        get_reward_fn("bleu")
    assert "explorer.reward_fn" in str(info.value)
    assert get_reward_fn("math_verify") is math_verify
    assert set(REWARD_FNS) == {"exact_match", "partial_credit", "math_verify"}


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so the answer is \\boxed{18}<eos>", "18"),
        ("18<eos><pad>", "18"),
        ("$18$ dollars", "18"),
        ("The answer is \\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{0.5}", "1/2"),
        ("\\boxed{3/4}", "\\frac{3}{4}"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{50\\%}", "0.5"),
        ("x = 2", "2"),
    ],
)
def test_math_verify_credits_equivalent_answers(response: str, answer: str) -> None:
    assert math_verify(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{17}", "18"),
        ("\\boxed{\\frac{3}{5}}", "0.75"),
        ("-4", "4"),
        ("1+1=2 so \\boxed{3}", "2"),  # the boxed answer counts, not the working
        ("\\boxed{5}<eos>\\boxed{18}", "18"),  # nothing after <eos> is read
        ("", "18"),
        ("no answer", "18"),
    ],
)
def test_math_verify_refuses_other_answers(response: str, answer: str) -> None:
    assert math_verify(response, answer) == 0.0


def test_math_verify_names_an_unreadable_reference_answer() -> None:
    with pytest.raises(ValueError, match=r"math_verify: cannot read the reference answer ''"):
        math_verify("\\boxed{1}", " ")


def test_math_verify_scores_outside_the_main_thread() -> None:
    # the explorer may score in a worker thread, where math-verify cannot set its SIGALRM timer
    with ThreadPoolExecutor(max_workers=1) as pool:
        scores = list(pool.map(math_verify, ["\\boxed{18}", "\\boxed{19}"], ["18", "18"]))
    assert scores == [1.0, 0.0]


def test_the_math_example_rolls_out_with_math_verify_rewards(
    tmp_path: Path, one_torch_thread: None
) -> None:
    cfg = load_config(
        REPO / "examples" / "grpo_math.yaml", overrides={"run_root": str(tmp_path / "run")}
    )
    tasks = load_taskset(cfg.explorer.taskset, cfg.explorer.seed).tasks
    assert len(tasks) == 12
    for task in tasks:  # every reference answer is readable and a boxed copy of it is right
        assert math_verify(f"so it is \\boxed{{{task.answer}}}", task.answer) == 1.0

    paths = RunPaths.of_config(cfg)
    create_initial_model(cfg, paths)
    rows = Explorer(cfg, paths).explore(step=1)
    assert len(rows) == cfg.explorer.tasks_per_step * cfg.algorithm.repeat_times
    answers = {task.task_id: task.answer for task in tasks}
    for row in rows:
        info = json.loads(row["info"])
        assert row["reward"] == math_verify(info["response"], answers[row["task_id"]])
