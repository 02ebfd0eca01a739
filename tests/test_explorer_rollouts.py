"""The explorer: schema-consistent rows, determinism, log-probs, reloading on version change."""

from __future__ import annotations

import json
import shutil
from datetime import UTC
from pathlib import Path

import pytest
import torch

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import published_weights_dir, set_latest_weights_version
from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.explorer import explorer as explorer_module
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.explorer.generation import SamplingParams, choose_next_tokens
from trinity_dagster.explorer.policy import load_policy, read_policy_weights
from trinity_dagster.explorer.rewards import exact_match
from trinity_dagster.paths import RunPaths

# the arithmetic set: its prompts differ in length, so left padding is exercised
SETTINGS = {
    "algorithm.repeat_times": 4,
    "explorer.tasks_per_step": 5,
    "explorer.taskset": "arithmetic",
    "explorer.eval_taskset": "arithmetic_eval",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(tmp_path: Path, **overrides: object) -> tuple[TrinityConfig, RunPaths]:
    cfg = load_config(None, {"run_root": str(tmp_path / "run"), **SETTINGS, **overrides})
    paths = RunPaths.of(cfg.run_root)
    create_initial_model(cfg, paths)
    return cfg, paths


def recomputed_logprobs(model: torch.nn.Module, row: dict, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) on the full, unpadded `tokens` at each response token."""
    tokens = torch.tensor([row["tokens"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits[0].float() / temperature, dim=-1)
    start = row["prompt_length"]
    return [float(logp[pos - 1, tokens[0, pos]]) for pos in range(start, tokens.shape[1])]


def strip_volatile(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("eid", "created_at")} for row in rows]


def test_rows_are_schema_consistent(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path)
    explorer = Explorer(cfg, paths, explorer_id="ex-a")
    rows = explorer.explore(step=3)
    assert len(rows) == 5 * 4
    assert len({row["eid"] for row in rows}) == len(rows)
    eos = explorer.tokenizer.eos_token_id
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
        response = row["tokens"][row["prompt_length"] :]
        assert 1 <= len(response) <= cfg.model.max_response_tokens
        assert len(row["tokens"]) <= cfg.model.max_model_len
        assert len(row["action_mask"]) == len(row["logprobs"]) == len(response)
        assert all(row["action_mask"]) and all(lp <= 0 for lp in row["logprobs"])
        assert eos not in response[:-1]  # generation stops at the first <eos>
        assert all(isinstance(t, int) for t in row["tokens"])
        assert row["explorer_id"] == "ex-a" and row["model_version"] == 0
        assert row["created_at"].tzinfo is UTC
        assert row["advantages"] is None and row["returns"] is None
        info = json.loads(row["info"])
        assert info["prompt"] == row["task_id"] + "=" and info["answer"]
        assert info["finished"] == (response[-1] == eos)
        decoded = explorer.tokenizer.decode(row["tokens"])
        assert decoded == "<bos>" + info["prompt"] + info["response"]
        assert row["reward"] == exact_match(info["response"], info["answer"])
    assert len(groups) == 5
    for group in groups.values():
        assert len(group) == 4
        assert len({r["task_id"] for r in group}) == 1
        assert len({tuple(r["tokens"][: r["prompt_length"]]) for r in group}) == 1


def test_logprobs_match_a_recomputation_on_the_full_tokens(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path, **{"explorer.temperature": 0.7, "explorer.top_p": 0.9})
    rows = Explorer(cfg, paths).explore(step=1)
    assert len({row["prompt_length"] for row in rows}) > 1  # left padding was exercised
    model = load_policy(paths, 0)
    for row in rows:
        expected = recomputed_logprobs(model, row, temperature=0.7)
        assert expected == pytest.approx(row["logprobs"], abs=1e-4)
        assert recomputed_logprobs(model, row) != pytest.approx(row["logprobs"], abs=1e-4)


def test_same_step_same_rows_other_step_other_rows(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path)
    first = Explorer(cfg, paths).explore(step=7)
    again = Explorer(cfg, paths).explore(step=7)
    assert strip_volatile(first) == strip_volatile(again)
    other = Explorer(cfg, paths).explore(step=8)
    assert [r["tokens"] for r in other] != [r["tokens"] for r in first]
    other_explorer = Explorer(cfg, paths, explorer_id="ex-b").explore(step=7)
    assert [r["task_id"] for r in other_explorer] == [r["task_id"] for r in first]
    assert {r["group_id"] for r in other_explorer}.isdisjoint(r["group_id"] for r in first)


def test_loads_once_and_updates_in_place_when_the_version_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, paths = make(tmp_path)
    v1 = published_weights_dir(paths, 1)
    shutil.copytree(published_weights_dir(paths, 0), v1)
    model = load_policy(paths, 1)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # version 1 is a different policy
    model.save_pretrained(str(v1))
    loads: list[int] = []
    reads: list[int] = []

    def counting_load(p: RunPaths, version: int) -> torch.nn.Module:
        loads.append(version)
        return load_policy(p, version)

    def counting_read(p: RunPaths, version: int) -> dict[str, torch.Tensor]:
        reads.append(version)
        return read_policy_weights(p, version)

    monkeypatch.setattr(explorer_module, "load_policy", counting_load)
    monkeypatch.setattr(explorer_module, "read_policy_weights", counting_read)
    explorer = Explorer(cfg, paths)
    explorer.explore(1)
    explorer.explore(2, version=0)
    assert (loads, reads) == ([0], [])
    loaded = explorer.policy(0)
    rows = explorer.explore(3, version=1)
    assert (loads, reads) == ([0], [1]) and {r["model_version"] for r in rows} == {1}
    assert explorer.policy(1) is loaded  # the same model, its weights replaced
    reference = load_policy(paths, 1)
    assert recomputed_logprobs(reference, rows[0]) == pytest.approx(rows[0]["logprobs"], abs=1e-4)
    set_latest_weights_version(paths, 1)
    explorer.explore(4)
    assert (loads, reads) == ([0], [1])
    explorer.explore(5, version=0)
    assert (loads, reads) == ([0], [1, 0]) and explorer.loaded_version == 0
    fresh = Explorer(cfg, paths).explore(5, version=0)
    assert [r["logprobs"] for r in fresh] == [r["logprobs"] for r in explorer.explore(5, 0)]


def test_a_failed_update_leaves_no_model_loaded(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path)
    v1 = published_weights_dir(paths, 1)
    shutil.copytree(published_weights_dir(paths, 0), v1)
    explorer = Explorer(cfg, paths)
    explorer.explore(1, version=0)
    weights = v1 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # torn
    with pytest.raises(ValueError, match=f"weights file {weights} is not readable safetensors"):
        explorer.explore(2, version=1)
    assert explorer.loaded_version == 0  # the read failed before the model was touched
    rows = explorer.explore(3, version=0)
    assert {r["model_version"] for r in rows} == {0}


def test_bad_setups_are_clear_errors(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_root": str(tmp_path / "empty")})
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json"):
        Explorer(cfg, RunPaths.of(cfg.run_root))
    cfg, paths = make(tmp_path)
    (paths.checkpoints / "latest_state_dict_iteration.txt").unlink()
    with pytest.raises(FileNotFoundError, match="no published weights"):
        Explorer(cfg, paths).explore(1)
    with pytest.raises(FileNotFoundError, match="no weights of version 4"):
        Explorer(cfg, paths).explore(1, version=4)
    tasks = tmp_path / "long.jsonl"
    tasks.write_text(
        json.dumps({"task_id": "ok", "prompt": "1+1=", "answer": "2"})
        + "\n"
        + json.dumps({"task_id": "long", "prompt": "1+" * 20 + "1=", "answer": "21"})
        + "\n"
    )
    cfg.explorer.taskset = str(tasks)
    with pytest.raises(ValueError, match=r"task 'long'.*43 tokens.*max_prompt_tokens \(24\)"):
        Explorer(cfg, paths)
    tasks.write_text(json.dumps({"task_id": "euro", "prompt": "1€=", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"task 'euro'.*\['€'\]"):
        Explorer(cfg, paths)


def test_top_p_and_greedy_choices_by_hand() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    logits = probs.log().repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    nucleus = choose_next_tokens(logits, SamplingParams(1, top_p=0.6), generator)
    counts = torch.bincount(nucleus, minlength=3).float() / len(nucleus)
    assert counts[2] == 0  # 0.5 + 0.3 reach 0.6: the third token is cut
    assert counts[0] == pytest.approx(0.5 / 0.8, abs=0.03)
    full = choose_next_tokens(logits, SamplingParams(1), generator)
    counts = torch.bincount(full, minlength=3).float() / len(full)
    assert counts.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    only_top = choose_next_tokens(logits, SamplingParams(1, top_p=0.1), generator)
    assert set(only_top.tolist()) == {0}
    greedy = choose_next_tokens(
        torch.tensor([[0.1, 2.0, 0.3]]), SamplingParams(1, greedy=True), None
    )
    assert greedy.tolist() == [1]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1, top_p=0.0)
