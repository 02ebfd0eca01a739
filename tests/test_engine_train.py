"""TrainEngine: one Megatron train step against a transformers + torch reference, refusals,
determinism, micro-batching, TP/DP equivalence, and exact resume from a saved state.

Engines run in worker subprocesses (`tests/engine_workers/train_worker.py`), not in the test
process, because Megatron's parallel state is global to a process. A worker may run several
engines one after the other (`run_engines`): each closes its process groups, and the second
trains bit-identically to a fresh process; the same-seed test still compares two processes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_workers.train_common import engine_config, make_batch, make_hf_dir
from trinity_dagster.engine.batch_check import BatchError, check_batch
from trinity_dagster.engine.state import EngineStateError, read_engine_state
from trinity_dagster.testing import free_port

REPO = Path(__file__).resolve().parents[1]
METRIC_NAMES = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/lr",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "critic/advantages/mean",
    "response_length/mean",
    "perf/throughput",
    "perf/total_num_tokens",
    "time/train_step",
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "tiny")


def run_worker(tmp: Path, name: str, spec: dict[str, Any], nproc: int = 1) -> Path:
    """Run the worker on `spec` in a fresh process (torchrun when nproc > 1); its out dir."""
    out = tmp / name
    spec = {"out": str(out), **spec}
    spec_file = tmp / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    module = ["-m", "tests.engine_workers.train_worker", str(spec_file)]
    if nproc == 1:
        cmd = [sys.executable, *module]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *module,
        ]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"worker {name} failed:\n{log}"
    return out


def run_engines(tmp: Path, name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Path]:
    """Run the named engine scenarios one after the other in one worker process (which saves
    the imports of a process per engine); each one's out dir by name."""
    outs = {run: tmp / name / run for run in runs}
    specs = [{**spec, "out": str(outs[run])} for run, spec in runs.items()]
    run_worker(tmp, name, {"runs": specs})
    return outs


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_{step}.pt")


def metrics(out: Path) -> list[dict[str, float]]:
    return json.loads((out / "metrics.json").read_text())


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert diff <= atol, f"{key}: max abs diff {diff} > {atol}"


# ---------------------------------------------------------------- reference (transformers)


def hf_logprobs_and_entropy(model, batch: dict[str, torch.Tensor]):
    """Per-token log-probs and entropies [B, T] from transformers' logits (position t+1)."""
    tokens = batch["tokens"]
    logits = model(input_ids=tokens, attention_mask=batch["attention_mask"].long()).logits
    logp_all = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    logp = torch.nn.functional.pad(logp_all.gather(-1, tokens[:, 1:, None])[..., 0], (1, 0))
    entropy = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    return logp, entropy


def load_hf(hf_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()


def reference_step(hf_dir: Path, batch: dict[str, torch.Tensor], lr: float, clip: float):
    """One GRPO step by hand on transformers' Llama with torch AdamW: metrics and weights."""
    model = load_hf(hf_dir)
    attention, mask = batch["attention_mask"], batch["response_mask"]
    logp, entropy = hf_logprobs_and_entropy(model, batch)
    # GRPO advantages: (r - mean_group) / (unbiased std_group + 1e-6)
    rewards = batch["rewards"].double()
    adv_seq = torch.empty_like(rewards)
    for g in batch["group_index"].unique():
        rows = batch["group_index"] == g
        r = rewards[rows]
        adv_seq[rows] = (r - r.mean()) / (r.std() + 1e-6)
    adv = adv_seq[:, None].expand_as(logp)
    old = batch["old_logprobs"].double()
    ratio = torch.exp(logp - old)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.28)
    n = mask.sum()
    loss = torch.maximum(unclipped, clipped)[mask].sum() / n
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, eps=1e-8).step()
    figures = {
        "actor/pg_loss": loss.item(),
        "actor/entropy": (entropy[mask].sum() / n).item(),
        "actor/ppo_kl": ((old - logp)[mask].sum() / n).item(),
        "actor/pg_clipfrac": ((clipped > unclipped)[mask].sum() / n).item(),
        "actor/grad_norm": grad_norm,
        "critic/advantages/mean": adv[mask].mean().item(),
        "response_length/mean": mask.sum(1).double().mean().item(),
        "perf/total_num_tokens": float(attention.sum()),
    }
    return figures, {k: v.detach().float() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- single process


def test_one_step_matches_reference_and_bad_batches_are_refused(hf_dir: Path, tmp_path: Path):
    out = run_worker(tmp_path, "one", {"hf_dir": str(hf_dir), "steps": [11], "bad_batches": True})
    refusals = json.loads((out / "refusals.json").read_text())
    assert refusals["unchanged"], "a refused batch changed the weights"
    errors = refusals["errors"]
    assert "'rewards' row 3" in errors["nan_reward"]
    assert "'old_logprobs' row 5" in errors["inf_old_logprobs"]
    assert "'response_mask' row 2: no response tokens" in errors["no_response"]
    assert "'rewards' has shape (7,)" in errors["shape_mismatch"]
    assert "empty" in errors["empty"]
    assert "'tokens' row 1" in errors["too_long"] and "max_model_len" in errors["too_long"]
    assert "train_step(2)" in errors["wrong_step"] and "step 0" in errors["wrong_step"]

    (got,) = metrics(out)
    assert got.keys() >= METRIC_NAMES
    assert all(math.isfinite(v) for v in got.values())
    w0, w1 = weights(out, 0), weights(out, 1)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0), "the step changed no weight"

    expected, ref_weights = reference_step(hf_dir, make_batch(11), lr=1e-2, clip=1.0)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    assert got["actor/lr"] == pytest.approx(1e-2)
    assert_weights_close(w1, ref_weights, atol=1e-4)


def test_same_seed_same_batches_give_bit_identical_weights(hf_dir: Path, tmp_path: Path):
    spec = {"hf_dir": str(hf_dir), "steps": [1, 2]}
    a, b = run_worker(tmp_path, "a", spec), run_worker(tmp_path, "b", spec)
    wa, wb = weights(a, 2), weights(b, 2)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics(a)[1]["actor/pg_loss"] == metrics(b)[1]["actor/pg_loss"]


def test_micro_batching_does_not_change_loss_or_weights(hf_dir: Path, tmp_path: Path):
    spec = {"hf_dir": str(hf_dir), "steps": [3, 4]}
    outs = run_engines(
        tmp_path,
        "micro",
        {
            "mb2": {**spec, "overrides": {"trainer.micro_batch_size": 2}},
            # a micro-batch size above the batch's 8 rows: the whole batch is one micro-batch
            "mb64": {**spec, "overrides": {"trainer.micro_batch_size": 64}},
        },
    )
    small, whole = outs["mb2"], outs["mb64"]
    for m_small, m_whole in zip(metrics(small), metrics(whole), strict=True):
        for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
            assert m_small[key] == pytest.approx(m_whole[key], abs=1e-5), key
    assert_weights_close(weights(small, 2), weights(whole, 2), atol=1e-5)


def test_kl_terms_entropy_bonus_recompute_and_sft_warmup(hf_dir: Path, tmp_path: Path):
    overrides = {
        "algorithm.kl_loss_fn": "k3",
        "algorithm.kl_loss_coef": 0.1,
        "algorithm.kl_penalty_fn": "low_var_kl",
        "algorithm.kl_penalty_coef": 0.05,
        "algorithm.entropy_coef": 0.01,
        "algorithm.recompute_old_logprobs": True,
        "trainer.sft_warmup_steps": 1,
    }
    out = run_worker(
        tmp_path, "kl", {"hf_dir": str(hf_dir), "steps": [21, 22], **{"overrides": overrides}}
    )
    first, second = metrics(out)
    assert all(math.isfinite(v) for m in (first, second) for v in m.values())
    # Step 1 is SFT: the loss is the token-mean NLL of the responses under the initial model.
    batch = make_batch(21)
    with torch.no_grad():
        logp, entropy = hf_logprobs_and_entropy(load_hf(hf_dir), batch)
    mask = batch["response_mask"]
    assert first["actor/pg_loss"] == pytest.approx(-logp[mask].mean().item(), rel=1e-5)
    assert first["actor/entropy"] == pytest.approx(entropy[mask].mean().item(), rel=1e-5)
    # Policy == reference at step 1, and old log-probs are recomputed before each step.
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert first["critic/kl"] == pytest.approx(0.0, abs=1e-7)
    for m in (first, second):
        assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    # After one update the policy has moved away from the frozen reference.
    assert second["actor/kl_loss"] > 1e-6 and second["critic/kl"] > 1e-6
    expected = second["actor/pg_loss"] + 0.1 * second["actor/kl_loss"]
    expected -= 0.01 * second["actor/entropy"]
    assert second["actor/loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="grpo"),
        pytest.param(
            {
                "algorithm.kl_loss_fn": "k3",
                "algorithm.kl_loss_coef": 0.1,
                "algorithm.entropy_coef": 0.01,
                "algorithm.recompute_old_logprobs": True,
                "algorithm.loss_agg_mode": "seq-mean-token-mean",
            },
            id="kl-entropy-recompute-seqmean",
        ),
    ],
)
def test_sequence_packing_trains_as_the_padded_rows(
    hf_dir: Path, tmp_path: Path, overrides: dict[str, Any]
):
    """Packed micro-batches (no padding) give the padded layout's metrics and weights."""
    spec = {"hf_dir": str(hf_dir), "steps": [31, 32]}
    assert not make_batch(31)["attention_mask"].all(), "the batch must hold padding"
    outs = run_engines(
        tmp_path,
        "packing",
        {
            "padded": {**spec, "overrides": overrides},
            "packed": {**spec, "overrides": {**overrides, "trainer.sequence_packing": True}},
        },
    )
    padded, packed = outs["padded"], outs["packed"]
    names = ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/kl_loss")
    for m_padded, m_packed in zip(metrics(padded), metrics(packed), strict=True):
        for name in (*names, "actor/grad_norm", "actor/pg_clipfrac"):
            assert m_packed[name] == pytest.approx(m_padded[name], abs=1e-5), name
    # Summation order differs (other matmul shapes); Adam at lr 1e-2 scales the rounding of
    # near-zero gradients up to ~1e-5 in the weights, as across TP/DP layouts.
    assert_weights_close(weights(packed, 2), weights(padded, 2), atol=1e-4)


@pytest.mark.parametrize(
    "background",
    [
        pytest.param(False, id="blocking"),
        pytest.param(True, id="background", marks=pytest.mark.slow),
    ],
)
def test_save_and_load_state_resume_exactly(hf_dir: Path, tmp_path: Path, background: bool):
    overrides = {
        "trainer.optim.lr_scheduler": "cosine",
        "trainer.optim.lr_warmup_steps": 1,
        "trainer.total_steps": 5,
    }
    state = tmp_path / "state"
    spec = {"hf_dir": str(hf_dir), "overrides": overrides}
    outs = run_engines(
        tmp_path,
        "resume",
        {
            "first": {
                **spec,
                "steps": [5, 6, 7],
                "save_after": 2,
                "save_dir": str(state),
                "background": background,
            },
            "resumed": {**spec, "steps": [7], "load_from": str(state)},
        },
    )
    first, resumed = outs["first"], outs["resumed"]
    assert json.loads((first / "save.json").read_text())["done"]
    assert read_engine_state(state)["step"] == 2
    w_first, w_resumed = weights(first, 3), weights(resumed, 3)
    assert all(torch.equal(w_first[k], w_resumed[k]) for k in w_first)
    assert metrics(resumed)[0]["actor/lr"] == metrics(first)[2]["actor/lr"]
    assert metrics(first)[0]["actor/lr"] == 0.0  # warmup starts at 0


# ---------------------------------------------------------------- torchrun, 2 ranks


@pytest.fixture(scope="module")
def one_rank(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two GRPO steps on one rank, the reference of the parallel layouts."""
    spec = {"hf_dir": str(hf_dir), "steps": [8, 9]}
    return run_worker(tmp_path_factory.mktemp("one_rank"), "single", spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"megatron.tensor_model_parallel_size": 2},
        {"megatron.data_parallel_size": 2},
        {"megatron.tensor_model_parallel_size": 2, "trainer.sequence_packing": True},
    ],
    ids=["tp", "dp", "tp-packed"],
)
def test_tensor_and_data_parallel_match_one_rank(
    hf_dir: Path, tmp_path: Path, layout: dict[str, Any], one_rank: Path
):
    spec = {"hf_dir": str(hf_dir), "steps": [8, 9]}
    single = one_rank
    parallel = run_worker(tmp_path, "parallel", {**spec, "overrides": layout}, nproc=2)
    for m_one, m_two in zip(metrics(single), metrics(parallel), strict=True):
        for name in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
            assert m_one[name] == pytest.approx(m_two[name], abs=1e-4), name
    for step in (1, 2):
        assert_weights_close(weights(single, step), weights(parallel, step), atol=1e-4)


# ---------------------------------------------------------------- in-process units


def test_check_batch_accepts_a_good_batch_and_names_problems():
    good = make_batch(0)
    check_batch(good, max_model_len=11, vocab_size=99, data_parallel_size=2)
    bad = dict(good, tokens=good["tokens"].clone())
    bad["tokens"][4, 0] = 99
    with pytest.raises(BatchError, match=r"'tokens' row 4: token id outside"):
        check_batch(bad, max_model_len=11, vocab_size=99)
    holes = dict(good, attention_mask=good["attention_mask"].clone())
    holes["attention_mask"][6, 1] = False
    with pytest.raises(BatchError, match=r"'attention_mask' row 6: not right-padded"):
        check_batch(holes, max_model_len=11, vocab_size=99)
    with pytest.raises(BatchError, match=r"'group_index' is missing"):
        check_batch(
            {k: v for k, v in good.items() if k != "group_index"}, max_model_len=11, vocab_size=99
        )
    with pytest.raises(BatchError, match="not divisible by the data-parallel size 3"):
        check_batch(good, max_model_len=11, vocab_size=99, data_parallel_size=3)


def test_incomplete_state_dir_is_refused(tmp_path: Path):
    (tmp_path / "dist").mkdir()
    with pytest.raises(EngineStateError, match=r"engine_state\.json is missing"):
        read_engine_state(tmp_path)


def test_cosine_schedule_with_warmup_follows_the_formula(tmp_path: Path):
    from trinity_dagster.engine.optim import build_scheduler

    cfg = engine_config(
        tmp_path,
        **{
            "trainer.optim.lr_scheduler": "cosine",
            "trainer.optim.lr_warmup_steps": 2,
            "trainer.optim.lr": 1e-3,
            "trainer.optim.min_lr": 1e-4,
        },
    )

    class Groups:
        def __init__(self) -> None:
            self.param_groups = [{"max_lr": 1e-3, "min_lr": 1e-4}]

    groups = Groups()
    scheduler = build_scheduler(groups, cfg.trainer.optim, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(groups.param_groups[0]["lr"])
        scheduler.step(1)
    expected = [0.0, 5e-4, 1e-3] + [
        1e-4 + 0.5 * (1 + math.cos(math.pi * (n - 2) / 8)) * 9e-4 for n in range(3, 10)
    ]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
