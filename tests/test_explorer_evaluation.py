"""Evaluation metrics, demonstration rows, and an SFT-trained model that answers right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import published_weights_dir
from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.explorer.demonstrations import demonstration_rows
from trinity_dagster.explorer.evaluation import evaluate, score_responses, wilson_interval
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.explorer.policy import load_policy
from trinity_dagster.explorer.rewards import exact_match, partial_credit
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import Task, load_taskset
from trinity_dagster.tokenizer import build_tokenizer, load_tokenizer

MY_TASKS = [("3+4=", "7"), ("12-5=", "7"), ("9*9=", "81"), ("what is one?", "1"), ("2+2=", "4")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(tmp_path: Path, **overrides: object) -> tuple[TrinityConfig, RunPaths]:
    cfg = load_config(None, {"run_root": str(tmp_path / "run"), **overrides})
    paths = RunPaths.of(cfg.run_root)
    create_initial_model(cfg, paths)
    return cfg, paths


def test_score_responses_by_hand() -> None:
    tasks = [Task("a", "1+1=", "2"), Task("b", "9+9=", "18"), Task("c", "5-9=", "-4")]
    responses = ["2<eos>", "28<eos><pad>", " -4 <eos>"]
    metrics = score_responses("hand", tasks, responses, partial_credit)
    low, high = wilson_interval(2, 3)
    assert metrics == {
        "eval/hand/accuracy": pytest.approx(2 / 3),
        "eval/hand/accuracy/ci95_low": pytest.approx(low),
        "eval/hand/accuracy/ci95_high": pytest.approx(high),
        "eval/hand/reward/mean": pytest.approx((1 + 0.5 + 1) / 3),
        "eval/hand/tasks": 3.0,
    }
    with pytest.raises(ValueError, match="one response per task"):
        score_responses("hand", tasks, responses[:2], exact_match)


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [
        # Wilson score intervals at z = 1.96, worked out by hand from the formula
        (0, 10, 0.0, 0.27753),
        (5, 10, 0.23659, 0.76341),
        (10, 10, 0.72247, 1.0),
        (100, 500, 0.16729, 0.23729),
        (250, 500, 0.45634, 0.54366),
    ],
)
def test_wilson_interval(successes: int, n: int, low: float, high: float) -> None:
    assert wilson_interval(successes, n) == (
        pytest.approx(low, abs=1e-5),
        pytest.approx(high, abs=1e-5),
    )


def test_wilson_interval_refuses_impossible_counts() -> None:
    for successes, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="successes"):
            wilson_interval(successes, n)


def test_demonstration_rows(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_root": str(tmp_path / "run"), "algorithm.repeat_times": 2})
    rows = demonstration_rows(cfg, n=6, seed=3, model_version=2)
    assert len(rows) == 6 and len({r["task_id"] for r in rows}) == 6
    assert [r["task_id"] for r in rows] == [
        r["task_id"] for r in demonstration_rows(cfg, n=6, seed=3)
    ]
    tok = build_tokenizer()
    for row in rows:
        info = json.loads(row["info"])
        assert info["demonstration"] is True
        response = row["tokens"][row["prompt_length"] :]
        assert tok.decode(row["tokens"][: row["prompt_length"]]) == "<bos>" + info["prompt"]
        assert tok.decode(response) == info["answer"] + "<eos>"
        expression = re.sub(r"\b0+(\d)", r"\1", info["prompt"][:-1])  # "08+57" -> "8+57"
        assert info["answer"] == str(eval(expression, {"__builtins__": {}}))
        assert row["logprobs"] == [0.0] * len(response)
        assert row["action_mask"] == [True] * len(response)
        assert row["reward"] == 1.0 and row["model_version"] == 2
    groups = [r["group_id"] for r in rows]
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4] == groups[5]
    with pytest.raises(ValueError, match=r"5 demonstrations.*repeat_times \(2\)"):
        demonstration_rows(cfg, n=5, seed=3)
    cfg.buffer.batch_unit = "rows"
    assert len(demonstration_rows(cfg, n=5, seed=3)) == 5


def sft(model: torch.nn.Module, rows: list[dict], steps: int) -> None:
    """Plain cross-entropy on the response tokens of `rows` (an independent trainer)."""
    width = max(len(r["tokens"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        n, p = len(row["tokens"]), row["prompt_length"]
        ids[i, :n] = torch.tensor(row["tokens"])
        mask[i, :n] = 1
        labels[i, p:n] = ids[i, p:n]
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrinityConfig, RunPaths]:
    """Version 1: SFT on all of MY_TASKS; version 2: SFT on the first three only."""
    root = tmp_path_factory.mktemp("trained")
    tasks = root / "mine.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in MY_TASKS))
    cfg, paths = make(
        root,
        **{
            "explorer.taskset": str(tasks),
            "explorer.eval_taskset": str(tasks),
            "explorer.tasks_per_step": 5,
            "algorithm.repeat_times": 2,
            "buffer.batch_unit": "rows",
        },
    )
    rows = demonstration_rows(cfg, n=len(MY_TASKS), seed=0)
    assert {r["task_id"] for r in rows} == {f"mine-{i}" for i in range(1, 6)}
    for version, subset in ((1, rows), (2, [r for r in rows if r["task_id"] <= "mine-3"])):
        model = load_policy(paths, 0)
        sft(model, subset, steps=150)
        model.save_pretrained(str(published_weights_dir(paths, version)))
    return cfg, paths


def transformers_greedy(model: torch.nn.Module, tok, prompt: str, max_new: int) -> str:
    """The reference: `generate(do_sample=False)` on one unpadded prompt, decoded."""
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok.decode(out[0, ids.shape[1] :])


def test_a_model_trained_on_the_answers_scores_one(
    trained_run: tuple[TrinityConfig, RunPaths],
) -> None:
    cfg, paths = trained_run
    low, _ = wilson_interval(5, 5)
    assert evaluate(cfg, paths, version=1) == {
        "eval/mine/accuracy": 1.0,
        "eval/mine/accuracy/ci95_low": pytest.approx(low),
        "eval/mine/accuracy/ci95_high": 1.0,
        "eval/mine/reward/mean": 1.0,
        "eval/mine/tasks": 5.0,
    }
    assert evaluate(cfg, paths, version=0)["eval/mine/accuracy"] == 0.0


def test_evaluate_matches_transformers_greedy_generate(
    trained_run: tuple[TrinityConfig, RunPaths],
) -> None:
    cfg, paths = trained_run
    cfg = cfg.model_copy(deep=True)
    cfg.explorer.reward_fn = "partial_credit"
    metrics = evaluate(cfg, paths, version=2, n_tasks=4)
    model, tok = load_policy(paths, 2), load_tokenizer(paths.tokenizer)
    tasks = load_taskset(cfg.explorer.eval_taskset, cfg.explorer.seed).head(4)
    responses = [
        transformers_greedy(model, tok, t.prompt, cfg.model.max_response_tokens) for t in tasks
    ]
    pairs = list(zip(responses, tasks, strict=True))
    accuracy = sum(exact_match(r, t.answer) for r, t in pairs) / 4
    reward = sum(partial_credit(r, t.answer) for r, t in pairs) / 4
    assert 0.5 <= accuracy < 1.0  # learned the first three, not the fourth
    assert metrics["eval/mine/accuracy"] == pytest.approx(accuracy)
    assert metrics["eval/mine/reward/mean"] == pytest.approx(reward)
    assert metrics["eval/mine/tasks"] == 4


def test_explorer_rollouts_of_a_trained_model_end_at_eos(
    trained_run: tuple[TrinityConfig, RunPaths],
) -> None:
    cfg, paths = trained_run
    cfg = cfg.model_copy(deep=True)
    cfg.explorer.temperature = 0.5  # sharpen sampling: almost every rollout is right
    explored = Explorer(cfg, paths).explore(step=1, version=1)
    eos = load_tokenizer(paths.tokenizer).eos_token_id
    assert len(explored) == 10
    assert sum(r["reward"] for r in explored) >= 8
    model = load_policy(paths, 1)
    for row in explored:
        if row["reward"] == 1.0:
            assert row["tokens"][-1] == eos and json.loads(row["info"])["finished"]
        tokens = torch.tensor([row["tokens"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0] / 0.5, dim=-1)
        start = row["prompt_length"]
        expected = [float(logp[i - 1, tokens[0, i]]) for i in range(start, tokens.shape[1])]
        assert row["logprobs"] == pytest.approx(expected, abs=1e-4)
