"""The baseline of `bench peer`: a plain single-process GRPO loop must be the same algorithm
as ours (on-policy log-probs, the same tasks as the built-in explorer), or its ratio means
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.bench_peer import PlainLoop, layout, make_sft_model, round_ratios
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.paths import RunPaths


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory: pytest.TempPathFactory) -> PlainLoop:
    root = tmp_path_factory.mktemp("peer")
    made = make_sft_model(root, sft_steps=3)
    assert made["sft_steps"] == 3 and (root / "sft" / "model.safetensors").is_file()
    return PlainLoop(root / "sft", rows=16)


def test_generated_logprobs_are_what_the_training_forward_computes(plain_loop: PlainLoop) -> None:
    tasks = plain_loop.tasks(1)
    prompts = [plain_loop.tokenizer.encode(t.prompt) for t in tasks]
    responses, logprobs = plain_loop.generate(prompts)
    assert [len(r) for r in responses] == [len(lp) for lp in logprobs]
    rows = layout(prompts, responses, plain_loop.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = plain_loop.model(
            input_ids=rows["ids"], attention_mask=rows["attention"], position_ids=rows["positions"]
        ).logits
    recomputed = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    recomputed = recomputed.gather(-1, rows["ids"][:, 1:, None])[..., 0]
    width = rows["ids"].shape[1] - max(len(r) for r in responses)
    for row, lps in enumerate(logprobs):
        got = recomputed[row, width - 1 : width - 1 + len(lps)]
        assert got.tolist() == pytest.approx(lps, abs=1e-4)


def test_a_step_draws_the_built_in_explorers_tasks_and_updates_the_model(
    plain_loop: PlainLoop, tmp_path: Path
) -> None:
    config = plain_loop.config.model_copy(update={"run_root": str(tmp_path / "run")})
    paths = RunPaths.of_config(config)
    create_initial_model(config, paths)  # from model.path: the SFT model
    explorer_tasks = Explorer(config, paths).sample_tasks(4)
    assert [t.task_id for t in plain_loop.tasks(4)] == [t.task_id for t in explorer_tasks]
    before = {k: v.clone() for k, v in plain_loop.model.state_dict().items()}
    # a reward that differs within groups, so advantages are not all zero
    plain_loop.reward_fn = lambda response, answer: float(len(response) % 2)
    done = plain_loop.step(4)
    assert done["step_s"] == pytest.approx(done["generate_s"] + done["train_s"])
    assert 0.0 <= done["reward"] <= 1.0
    changed = [k for k, v in plain_loop.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # an optimizer step happened


def test_each_round_is_divided_by_its_own_plain_run_and_the_median_is_reported() -> None:
    plain = [{"step_s": 0.10}, {"step_s": 0.20}, {"step_s": 0.10}]
    ours = [{"step_s": 0.15}, {"step_s": 0.20}, {"step_s": 0.30}]
    assert round_ratios("ratio_64_offset1", plain, ours) == {
        "ratio_64_offset1": 1.5,
        "ratios_64_offset1": [1.5, 1.0, 3.0],
    }
