"""PPO with a critic on the Megatron engine: one step against a transformers + torch reference
(values, GAE, the value loss, both updates), the critic's warm-up, exact resume in the middle
of it, where the critic starts from, its HF export, and TP/DP/packing equivalence.

Engines run in worker subprocesses (`tests/engine_workers/train_worker.py`), several to a
worker where a test needs more than one, as in test_engine_train.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_workers.train_common import VOCAB, make_batch, make_hf_dir
from tests.test_algorithms_value import closed_form_gae, whiten
from tests.test_engine_train import (
    assert_weights_close,
    hf_logprobs_and_entropy,
    load_hf,
    metrics,
    run_engines,
    run_worker,
    weights,
)
from trinity_dagster.commands.convert_cmd import export_checkpoint

PPO: dict[str, Any] = {
    "algorithm.algorithm_type": "ppo",
    "algorithm.repeat_times": 4,
    "algorithm.kl_loss_fn": "none",  # the reference below has no KL term
    "algorithm.gamma": 0.95,
    "algorithm.lam": 0.9,
    "critic.optim.lr": 1e-3,
    "critic.cliprange_value": 0.5,
}
CRITIC_METRICS = {
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/values/mean",
    "critic/returns/mean",
    "critic/advantages/mean",
    "critic/vf_explained_var",
    "critic/grad_norm",
    "critic/lr",
    "critic/warmup",
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "tiny")


def critic_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"critic_weights_{step}.pt")


def load_critic(path: Path):
    from transformers import LlamaForTokenClassification

    return LlamaForTokenClassification.from_pretrained(path, attn_implementation="eager").float()


def reference_ppo_step(hf_dir: Path, critic_dir: Path, batch: dict[str, torch.Tensor]):
    """One PPO step by hand: transformers' actor and token-classification critic, GAE by its
    closed form, the clipped losses written out, torch AdamW for both models."""
    actor, critic = load_hf(hf_dir), load_critic(critic_dir)
    attention, mask = batch["attention_mask"], batch["response_mask"]
    values_all = critic(input_ids=batch["tokens"], attention_mask=attention.long()).logits[..., 0]
    vpreds = torch.nn.functional.pad(values_all[:, :-1], (1, 0))  # V before token t
    values = vpreds.detach().double()
    last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(len(last)), last] = batch["rewards"].double()
    raw, returns = closed_form_gae(token_rewards, values, mask, PPO["algorithm.gamma"], 0.9)
    adv = whiten(raw, mask)
    n = mask.sum()
    # value loss: 0.5 token-mean of max((v - R)^2, (clip(v, V +- 0.5) - R)^2); v = V here
    clipped = torch.maximum(torch.minimum(vpreds, values.float() + 0.5), values.float() - 0.5)
    vf = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    vf_loss = 0.5 * vf[mask].sum() / n
    vf_loss.backward()
    critic_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0).item()
    torch.optim.AdamW(critic.parameters(), lr=1e-3, weight_decay=0.0, eps=1e-8).step()
    # actor: PPO clip 0.2 / 0.28 (the engine tests' config), dual clip 3 (the ppo preset)
    logp, _ = hf_logprobs_and_entropy(actor, batch)
    ratio = torch.exp(logp - batch["old_logprobs"].double())
    loss_t = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    loss_t = torch.where(adv < 0, torch.minimum(loss_t, -3.0 * adv), loss_t)
    pg_loss = loss_t[mask].sum() / n
    pg_loss.backward()
    torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
    torch.optim.AdamW(actor.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-8).step()
    kept_r, kept_v = returns[mask], values[mask]
    figures = {
        "critic/vf_loss": vf_loss.item(),
        "critic/vf_clipfrac": 0.0,
        "critic/vpred_mean": kept_v.mean().item(),
        "critic/values/mean": kept_v.mean().item(),
        "critic/returns/mean": kept_r.mean().item(),
        "critic/vf_explained_var": (1 - (kept_r - kept_v).var() / (kept_r.var() + 1e-5)).item(),
        "critic/grad_norm": critic_norm,
        "actor/pg_loss": pg_loss.item(),
    }
    state = {k: v.detach().float() for k, v in actor.state_dict().items()}
    critic_state = {k: v.detach().float() for k, v in critic.state_dict().items()}
    return figures, state, critic_state


def error_of(out: Path) -> str:
    """The error an `expect_error` run of `run_engines` stopped with."""
    return json.loads((out / "error.json").read_text())["error"]


def test_ppo_step_matches_a_hand_written_reference(hf_dir: Path, tmp_path: Path):
    """Rows that carry advantages are refused first (the critic estimates them) and change
    nothing; then one PPO step matches the reference in metrics and both models' weights."""
    critic0 = tmp_path / "critic0"
    spec = {"steps": [11], "overrides": PPO, "export_critic": str(critic0)}
    out = run_worker(tmp_path, "ppo", {"hf_dir": str(hf_dir), "with_advantages": True, **spec})
    (refusal,) = json.loads((out / "refusals.json").read_text())["errors"].values()
    assert "'advantages'" in refusal and "critic" in refusal
    (got,) = metrics(out)
    assert got.keys() >= CRITIC_METRICS
    assert got["critic/warmup"] == 0.0 and got["critic/lr"] == pytest.approx(1e-3)
    expected, actor_ref, critic_ref = reference_ppo_step(hf_dir, critic0, make_batch(11))
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    assert_weights_close(weights(out, 1), actor_ref, atol=1e-4)
    assert_weights_close(critic_weights(out, 1), critic_ref, atol=1e-5)
    config = json.loads((critic0 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"]
    assert config["id2label"] == {"0": "LABEL_0"}


def test_sft_then_warmup_train_only_the_critic_and_resume_exactly_in_its_middle(
    hf_dir: Path, tmp_path: Path
):
    """Step 1 is SFT (the critic idle), steps 2-3 the critic's warm-up (the actor still), 4-5
    PPO. At step 2 the critic takes the SFT actor's backbone. A state saved after step 2
    resumes steps 3-5 bit-identically, actor and critic."""
    overrides = {
        **PPO,
        "trainer.sft_warmup_steps": 1,
        "critic.warmup_steps": 2,
        "critic.optim.lr_scheduler": "cosine",
    }
    state = tmp_path / "state"
    spec = {"hf_dir": str(hf_dir), "overrides": overrides}
    outs = run_engines(
        tmp_path,
        "warmup",
        {
            "first": {**spec, "steps": [1, 2, 3, 4, 5], "save_after": 2, "save_dir": str(state)},
            "resumed": {**spec, "steps": [3, 4, 5], "load_from": str(state)},
        },
    )
    first, resumed = outs["first"], outs["resumed"]
    runs = metrics(first)
    assert runs[0]["actor/sft"] == 1.0 and "critic/vf_loss" not in runs[0]
    assert [m["critic/warmup"] for m in runs] == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert "actor/pg_loss" not in runs[1] and "actor/pg_loss" in runs[3]
    w = {step: weights(first, step) for step in (1, 2, 3, 4)}
    assert all(torch.equal(w[1][k], w[3][k]) for k in w[1]), "a warm-up step moved the actor"
    assert any(not torch.equal(w[3][k], w[4][k]) for k in w[3])
    c2, c3 = critic_weights(first, 2), critic_weights(first, 3)
    assert any(not torch.equal(c2[k], c3[k]) for k in c2), "a warm-up step left the critic"
    assert runs[2]["critic/lr"] < runs[1]["critic/lr"]  # the critic's own cosine schedule
    # the critic began step 2 as the SFT actor's backbone; its one update moved each weight
    # by at most about its lr (Adam), far less than SFT moved the actor from the start
    backbone = {k: v for k, v in c2.items() if not k.startswith("score.")}
    assert_weights_close(backbone, {k: w[1][k] for k in backbone}, atol=1.5e-3)
    initial = load_hf(hf_dir).state_dict()
    assert max((w[1][k] - initial[k]).abs().max().item() for k in backbone) > 5e-3

    for step in (3, 4, 5):
        pairs = [
            (weights(resumed, step), weights(first, step)),
            (critic_weights(resumed, step), critic_weights(first, step)),
        ]
        for got, want in pairs:
            assert all(torch.equal(got[k], want[k]) for k in want), f"step {step}"
    for got_m, want_m in zip(metrics(resumed), runs[2:], strict=True):
        timing = ("time/train_step", "perf/throughput")
        assert {k: v for k, v in got_m.items() if k not in timing} == {
            k: v for k, v in want_m.items() if k not in timing
        }

    exported = export_checkpoint(state, tmp_path / "critic_hf", critic=True)
    model = load_critic(exported)
    assert_weights_close({k: v.float() for k, v in model.state_dict().items()}, c2, atol=0.0)


def test_where_the_critic_starts_and_what_is_refused(hf_dir: Path, tmp_path: Path):
    """A token-classification directory gives the critic its backbone and head; a wrong head
    shape, a vocabulary other than the actor's, and a state saved without a critic are
    refused by name."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(5)
    scorer = LlamaForTokenClassification(LlamaConfig.from_pretrained(hf_dir, num_labels=1))
    scorer.save_pretrained(tmp_path / "scorer")
    two_labels = LlamaForTokenClassification(LlamaConfig.from_pretrained(hf_dir, num_labels=2))
    two_labels.save_pretrained(tmp_path / "two_labels")
    other_vocab = make_hf_dir(tmp_path / "other_vocab", vocab=VOCAB + 1)
    grpo_state = tmp_path / "grpo_state"
    spec: dict[str, Any] = {"hf_dir": str(hf_dir), "steps": []}

    def critic_from(path: Path) -> dict[str, Any]:
        return {**spec, "overrides": {**PPO, "critic.model_path": str(path)}}

    outs = run_engines(
        tmp_path,
        "starts",
        {
            "scorer": {**critic_from(tmp_path / "scorer"), "export_critic": str(tmp_path / "x")},
            "two_labels": {**critic_from(tmp_path / "two_labels"), "expect_error": True},
            "vocab": {**critic_from(other_vocab), "expect_error": True},
            "grpo": {**spec, "steps": [1], "save_after": 1, "save_dir": str(grpo_state)},
            "no_critic": {
                **spec,
                "overrides": PPO,
                "load_from": str(grpo_state),
                "expect_error": True,
            },
        },
    )
    again = load_critic(tmp_path / "x").state_dict()
    assert all(torch.equal(again[k], v) for k, v in scorer.state_dict().items())
    assert re.search(
        r"score.weight in .*two_labels.*\(2, 32\), model expects \(1, 32\)",
        error_of(outs["two_labels"]),
    )
    assert "vocab_size 100 differs from the actor's 99" in error_of(outs["vocab"])
    assert "grpo_state holds no critic" in error_of(outs["no_critic"])


@pytest.fixture(scope="module")
def one_rank(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two PPO steps on one rank, the reference of the parallel layouts."""
    spec = {"hf_dir": str(hf_dir), "steps": [8, 9], "overrides": PPO}
    return run_worker(tmp_path_factory.mktemp("one_rank"), "single", spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"megatron.tensor_model_parallel_size": 2, "trainer.sequence_packing": True},
        {"megatron.data_parallel_size": 2},
    ],
    ids=["tp-packed", "dp"],
)
def test_ppo_under_tensor_and_data_parallel_matches_one_rank(
    hf_dir: Path, tmp_path: Path, layout: dict[str, Any], one_rank: Path
):
    spec = {"hf_dir": str(hf_dir), "steps": [8, 9], "overrides": PPO}
    single = one_rank
    parallel = run_worker(tmp_path, "parallel", {**spec, "overrides": {**PPO, **layout}}, nproc=2)
    for m_one, m_two in zip(metrics(single), metrics(parallel), strict=True):
        for name in ("critic/vf_loss", "critic/values/mean", "critic/grad_norm", "actor/pg_loss"):
            assert m_one[name] == pytest.approx(m_two[name], abs=1e-4), name
    for step in (1, 2):
        assert_weights_close(weights(single, step), weights(parallel, step), atol=1e-4)
        assert_weights_close(critic_weights(single, step), critic_weights(parallel, step), 1e-4)
