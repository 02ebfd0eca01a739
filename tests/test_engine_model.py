"""Megatron model from HF configs, HF import/export round trips and logits parity.

Megatron's parallel state is global, so everything that initializes it runs in a fresh
process (tests/engine_workers/); this process only builds HF models and compares results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.hf_weights import _full_hf, _local_shard, _qkv_interleave, _Slot
from trinity_dagster.engine.model import (
    UnsupportedModelError,
    causal_attention_mask,
    local_layer_spec,
    padded_vocab_size,
    transformer_config_from_hf,
)
from trinity_dagster.engine.packing import Packing
from trinity_dagster.engine.sdpa_attention import SDPAttention
from trinity_dagster.testing import free_port

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "engine_workers"
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=5000.0,
)
# name: (model class, config class, vocab, tied, shard size or None)
CASES = {
    "llama_tied": (LlamaForCausalLM, LlamaConfig, 50, True, None),
    "llama_untied": (LlamaForCausalLM, LlamaConfig, 50, False, None),
    "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config, 51, True, None),
    "qwen2_untied_sharded": (Qwen2ForCausalLM, Qwen2Config, 51, False, "40KB"),
}


def make_hf_model(root: Path, name: str) -> Path:
    """Save a tiny random HF model of case `name` (every weight random) under root/name/hf."""
    model_cls, config_cls, vocab, tied, shard = CASES[name]
    config = config_cls(vocab_size=vocab, tie_word_embeddings=tied, **TINY)
    torch.manual_seed(list(CASES).index(name))
    model = model_cls(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    hf_dir = root / name / "hf"
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(hf_dir, safe_serialization=True, **kwargs)
    (hf_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return hf_dir


def read_safetensors_dir(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def run_worker(script: str, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, str(WORKERS / script), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(WORKERS / script), *args,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def check_roundtrip(case_dir: Path) -> None:
    """Exported tensors and names equal the source bit for bit; config and tokenizer kept."""
    source = read_safetensors_dir(case_dir / "hf")
    exported = read_safetensors_dir(case_dir / "export")
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    src_cfg = json.loads((case_dir / "hf" / "config.json").read_text())
    out_cfg = json.loads((case_dir / "export" / "config.json").read_text())
    for key in ("model_type", "vocab_size", "tie_word_embeddings", "num_key_value_heads"):
        assert out_cfg[key] == src_cfg[key], key
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert (case_dir / "export" / name).read_bytes() == (case_dir / "hf" / name).read_bytes()


def check_case(case_dir: Path) -> None:
    """The round trip holds and Megatron logits match transformers' within 1e-4."""
    check_roundtrip(case_dir)
    src_cfg = json.loads((case_dir / "hf" / "config.json").read_text())
    saved = torch.load(case_dir / "megatron_logits.pt")
    hf_model = AutoModelForCausalLM.from_pretrained(
        case_dir / "export", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf_model(input_ids=saved["tokens"], attention_mask=saved["mask"]).logits
    logits = saved["logits"]
    assert logits.shape == ref.shape == (2, 9, src_cfg["vocab_size"])
    valid = saved["mask"].bool()
    diff = (logits - ref).abs()[valid].max().item()
    assert diff < 1e-4, f"{case_dir.name}: max abs logit diff {diff}"


@pytest.fixture(scope="module")
def hf_cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_cases")
    for name in CASES:
        make_hf_model(root, name)
    return root


def _fresh_copy(hf_cases: Path, tmp_path: Path) -> list[Path]:
    dirs = []
    for name in CASES:
        target = tmp_path / name / "hf"
        target.mkdir(parents=True)
        for file in (hf_cases / name / "hf").iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        dirs.append(tmp_path / name)
    return dirs


def test_roundtrip_and_logits_parity_tp1(hf_cases: Path, tmp_path: Path) -> None:
    cases = _fresh_copy(hf_cases, tmp_path)
    assert (cases[-1] / "hf" / "model.safetensors.index.json").is_file()  # sharded source
    stale = cases[0] / "export"  # a previous sharded export in the target is replaced
    stale.mkdir()
    for file in (cases[-1] / "hf").glob("model*"):
        (stale / file.name).write_bytes(file.read_bytes())
    run_worker("hf_roundtrip_worker.py", "--tp", "1", *map(str, cases))
    assert not (stale / "model.safetensors.index.json").exists()
    for case in cases:
        check_case(case)


@pytest.mark.slow
def test_roundtrip_and_logits_parity_tp2(hf_cases: Path, tmp_path: Path) -> None:
    cases = _fresh_copy(hf_cases, tmp_path)
    run_worker("hf_roundtrip_worker.py", "--tp", "2", *map(str, cases), nproc=2)
    for case in cases:
        check_case(case)


@pytest.mark.slow
def test_roundtrip_pipeline_parallel_pp2(hf_cases: Path, tmp_path: Path) -> None:
    cases = _fresh_copy(hf_cases, tmp_path)
    run_worker("hf_roundtrip_worker.py", "--tp", "1", "--pp", "2", *map(str, cases), nproc=2)
    for case in cases:
        check_roundtrip(case)


def test_load_rejects_missing_and_misshaped_tensors(hf_cases: Path, tmp_path: Path) -> None:
    good = hf_cases / "llama_untied" / "hf"
    tensors = read_safetensors_dir(good)
    config = (good / "config.json").read_text()
    bad = {}
    wrong = torch.ones(8, 4)
    for label, edit in {
        "missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        "misshaped": lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": wrong}),
        "extra": lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.ones(2, 2)}),
    }.items():
        broken = dict(tensors)
        edit(broken)
        directory = tmp_path / label
        directory.mkdir()
        save_file(broken, directory / "model.safetensors")
        (directory / "config.json").write_text(config)
        bad[label] = directory
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(config)
    out = run_worker("hf_load_errors_worker.py", str(good), *map(str, bad.values()), str(empty))
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results[str(bad["missing"])] == (
        "HFWeightsError: tensor 'model.layers.1.mlp.up_proj.weight' is missing from the HF weights"
    )
    misshaped = results[str(bad["misshaped"])]
    assert misshaped.startswith("HFWeightsError: model.layers.0.self_attn.k_proj.weight in ")
    assert "shape (8, 4), config.json implies (32, 64)" in misshaped
    assert results[str(bad["extra"])].endswith(
        "tensors not used by the model: model.layers.7.mlp.up_proj.weight"
    )
    assert "neither model.safetensors nor model.safetensors.index.json" in results[str(empty)]


def test_init_distributed_checks_world_size_and_reinitializes_cleanly() -> None:
    code = textwrap.dedent(
        """
        import json
        from trinity_dagster.config import MegatronConfig
        from trinity_dagster.engine.parallel import destroy_distributed, init_distributed
        out = {}
        try:
            init_distributed(MegatronConfig(tensor_model_parallel_size=2), seed=0)
        except ValueError as err:
            out["mismatch"] = str(err)
        info = init_distributed(MegatronConfig(), seed=0)
        try:
            init_distributed(MegatronConfig(), seed=0)
        except RuntimeError as err:
            out["twice"] = str(err)
        destroy_distributed()
        destroy_distributed()
        again = init_distributed(MegatronConfig(), seed=1)
        destroy_distributed()
        out["infos"] = [[i.rank, i.world_size, i.tp_size, i.backend] for i in (info, again)]
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mismatch"] == (
        "world size 1 (WORLD_SIZE from the launcher) does not equal "
        "megatron.tensor_model_parallel_size (2) * pipeline_model_parallel_size (1) "
        "* data_parallel_size (1) = 2"
    )
    assert "already initialized" in out["twice"]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert out["infos"] == [[0, 1, 1, backend], [0, 1, 1, backend]]


def test_unpadded_logits_use_the_causal_fast_path_and_match_transformers(
    hf_cases: Path, tmp_path: Path
) -> None:
    """No padding: local_logits passes no mask, SDPAttention applies causality itself.

    Also: GPTModel returns the output layer's batch-first logits without copying them.
    """
    hf_dir, out = hf_cases / "llama_untied" / "hf", tmp_path / "logits.pt"
    code = textwrap.dedent(
        f"""
        import json, sys, torch
        from trinity_dagster.config import MegatronConfig
        from trinity_dagster.engine.hf_weights import load_hf_into_model
        from trinity_dagster.engine.model import build_gpt_model, model_logits
        from trinity_dagster.engine.parallel import destroy_distributed, init_distributed
        cfg = MegatronConfig()
        init_distributed(cfg, seed=0)
        hf_config = json.loads(open({str(hf_dir / "config.json")!r}).read())
        model = build_gpt_model(hf_config, cfg)
        load_hf_into_model(model, {str(hf_dir)!r})
        model.eval()
        tokens = torch.randint(0, hf_config["vocab_size"], (2, 9))
        with torch.no_grad():
            logits = [model_logits(model, tokens, m) for m in (None, torch.ones(2, 9))]
        core = type(model.decoder.layers[0].self_attention.core_attention).__name__
        seen = []
        model.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0]))
        with torch.no_grad():
            out = model(input_ids=tokens, position_ids=torch.arange(9).expand(2, 9),
                        attention_mask=None)
        no_copy = out.data_ptr() == seen[0].data_ptr() and out.shape == (2, 9, 50)
        torch.save({{"tokens": tokens, "logits": logits, "core": core, "no_copy": no_copy}},
                   {str(out)!r})
        destroy_distributed()
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = torch.load(out)
    assert saved["core"] == "SDPAttention"
    assert saved["no_copy"], "GPTModel copied the logits (batch-first output layer not active)"
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf_model(input_ids=saved["tokens"]).logits
    no_mask, all_ones = saved["logits"]
    assert torch.equal(no_mask, all_ones)
    diff = (no_mask - ref).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"


# ------------------------------------------------------------ pure layout and config checks


def _hf_cfg(**overrides: object) -> dict:
    cfg = dict(model_type="qwen2", vocab_size=51, tie_word_embeddings=False, **TINY)
    cfg.update(overrides)
    return cfg


def test_transformer_config_maps_hf_fields() -> None:
    cfg = transformer_config_from_hf(_hf_cfg(), MegatronConfig(tensor_model_parallel_size=2))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-6
    assert cfg.gated_linear_unit and cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.tensor_model_parallel_size == 2
    llama = transformer_config_from_hf(_hf_cfg(model_type="llama"), MegatronConfig())
    assert not llama.add_qkv_bias


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({"model_type": "gpt2"}, 1, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 1, "rope_scaling"),
        ({"hidden_act": "gelu"}, 1, "hidden_act 'gelu'"),
        ({"model_type": "llama", "attention_bias": True}, 1, "attention_bias"),
        ({}, 4, "tensor_model_parallel_size 4 must divide"),
    ],
)
def test_transformer_config_rejects_unsupported(overrides: dict, tp: int, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        transformer_config_from_hf(
            _hf_cfg(**overrides), MegatronConfig(tensor_model_parallel_size=tp)
        )


def test_padded_vocab_size() -> None:
    assert [padded_vocab_size(v, 2) for v in (50, 51)] == [50, 52]
    assert padded_vocab_size(51, 1) == 51


def test_causal_attention_mask_by_hand() -> None:
    mask = causal_attention_mask(2, 3, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    masked = [[[0, 1, 1], [0, 0, 1], [0, 0, 0]], [[0, 1, 1], [0, 0, 1], [0, 0, 1]]]
    assert mask.shape == (2, 1, 3, 3)
    assert mask[:, 0].int().tolist() == masked


def _rows(tag: int, n: int) -> torch.Tensor:
    """n rows of width 1 labelled tag*100 + row index."""
    return (tag * 100 + torch.arange(n, dtype=torch.float32)).unsqueeze(1)


def test_qkv_layout_is_interleaved_per_query_group() -> None:
    # 4 q heads, 2 groups, head dim 1: group g holds q heads 2g, 2g+1, then k_g, then v_g.
    q, k, v = _rows(1, 4), _rows(2, 2), _rows(3, 2)
    full = _qkv_interleave(q, k, v, groups=2)
    assert full.squeeze(1).tolist() == [100, 101, 200, 300, 102, 103, 201, 301]
    cfg = _hf_cfg(num_attention_heads=4, num_key_value_heads=2, hidden_size=4, head_dim=1)
    slot = _Slot(torch.empty(4, 1), ("q", "k", "v"), "qkv")
    shards = [_local_shard(slot, [q, k, v], cfg, tp=2, rank=r) for r in range(2)]
    assert shards[1].squeeze(1).tolist() == [102, 103, 201, 301]
    back = _full_hf(slot, shards, cfg, vocab=0)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_fc1_layout_shards_gate_and_up_separately() -> None:
    gate, up = _rows(1, 4), _rows(2, 4)
    slot = _Slot(torch.empty(4, 1), ("gate", "up"), "fc1")
    shards = [_local_shard(slot, [gate, up], {}, tp=2, rank=r) for r in range(2)]
    assert shards[0].squeeze(1).tolist() == [100, 101, 200, 201]
    assert shards[1].squeeze(1).tolist() == [102, 103, 202, 203]
    back = _full_hf(slot, shards, {}, vocab=0)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_vocab_layout_pads_rows_and_strips_them() -> None:
    emb = _rows(1, 5)
    slot = _Slot(torch.empty(3, 1), ("embed",), "vocab")
    shards = [_local_shard(slot, [emb], {}, tp=2, rank=r) for r in range(2)]
    assert shards[1].squeeze(1).tolist() == [103, 104, 0]
    assert torch.equal(_full_hf(slot, shards, {}, vocab=5)[0], emb)


# ------------------------------------------------------------ SDPA core attention


class _GroupOfSize:
    """Stands in for a tensor-parallel process group; SDPAttention only asks its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _sdpa(tp: int = 1, softmax_type: str = "vanilla") -> SDPAttention:
    """SDPAttention for the tiny config (4 heads, 2 KV groups, head dim 16) on a TP of `tp`."""
    config = transformer_config_from_hf(_hf_cfg(model_type="llama"), MegatronConfig())
    config.softmax_type = softmax_type
    groups = ProcessGroupCollection()
    groups.tp = _GroupOfSize(tp)
    return SDPAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=groups,
    )


def _attention_by_hand(q, k, v, masked: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) with masked scores at -inf) v, GQA by repeating K/V heads.

    q [s, b, np, d], k/v [s, b, ng, d], masked [b, 1, s, s] (True = masked) -> [s, b, np * d].
    """
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    out = probs @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_attention_matches_hand_formula_and_its_gradients(tp: int, padded: bool) -> None:
    attention = _sdpa(tp).train()
    seq, batch, heads, groups, dim = 7, 3, 4 // tp, 2 // tp, 16
    gen = torch.Generator().manual_seed(tp)
    inputs = [torch.randn(seq, batch, n, dim, generator=gen) for n in (heads, groups, groups)]
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[1, 4:] = False
    padding[2, 6:] = False
    masked = causal_attention_mask(batch, seq, padding if padded else None)
    results = []
    for fn, mask in ((attention, masked if padded else None), (_attention_by_hand, masked)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    assert results[0][0].shape == (seq, batch, heads * dim)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sdpa_attention_on_packed_rows_matches_the_padded_rows() -> None:
    """Rows packed back to back (thd) attend as the same rows padded: outputs and gradients."""
    attention = _sdpa().train()
    lengths = torch.tensor([5, 2, 7, 1])
    seq, batch, dim = 7, 4, 16
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(seq, batch, n, dim, generator=gen) for n in (4, 2, 2)]
    padding = torch.arange(seq) < lengths[:, None]
    packing = Packing.of(padding)
    weight = torch.randn(batch, seq, 4 * dim, generator=gen) * padding[..., None]
    results = []
    for packed in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        if packed:  # [s, b, n, d] -> [t, n, d] -> context [t, np * d] -> [b, s, np * d]
            rows = [packing.pack(t.transpose(0, 1)).squeeze(0) for t in leaves]
            out = packing.unpack(attention(*rows, None, packed_seq_params=packing.seq_params()))
        else:
            out = attention(*leaves, causal_attention_mask(batch, seq, padding)).transpose(0, 1)
        (out * weight).sum().backward()
        results.append([out * padding[..., None], *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert packing.cu_seqlens.tolist() == [0, 5, 7, 14, 15]
    assert packing.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4, 5, 6, 0]]


def test_sdpa_attention_gives_zeros_for_a_fully_masked_row() -> None:
    attention = _sdpa()
    q, k, v = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16), torch.randn(3, 1, 2, 16)
    masked = causal_attention_mask(1, 3, torch.tensor([[0, 1, 1]]))  # row 0 sees no key
    q.requires_grad_()
    out = attention(q, k, v, masked)
    out.sum().backward()
    assert torch.equal(out[0], torch.zeros(1, 64))
    torch.testing.assert_close(out[1:], _attention_by_hand(q, k, v, masked)[1:])
    assert torch.isfinite(q.grad).all()


def test_sdpa_attention_rejects_bad_input() -> None:
    attention = _sdpa(tp=2)
    q, kv = torch.randn(5, 1, 2, 16), torch.randn(5, 1, 1, 16)
    mask = causal_attention_mask(1, 5)
    with pytest.raises(ValueError, match="query has 4 heads, expected 2 per tensor-parallel"):
        attention(torch.randn(5, 1, 4, 16), kv, kv, mask)
    with pytest.raises(ValueError, match="value has 2 heads, expected 1 per tensor-parallel"):
        attention(q, kv, torch.randn(5, 1, 2, 16), mask)
    with pytest.raises(ValueError, match="attention_mask must be boolean"):
        attention(q, kv, kv, mask.float())
    with pytest.raises(ValueError, match=r"attention_mask shape \(1, 1, 4, 4\) is not"):
        attention(q, kv, kv, causal_attention_mask(1, 4))
    with pytest.raises(ValueError, match="packed format 'sbhd' is not 'thd'"):
        attention(q[:, 0], kv[:, 0], kv[:, 0], None, packed_seq_params=PackedSeqParams("sbhd"))
    with pytest.raises(ValueError, match="attention_bias is not supported"):
        attention(q, kv, kv, mask, attention_bias=torch.zeros(1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"\(layer 1\): softmax_type 'learnable' is not"):
        _sdpa(softmax_type="learnable")


def test_local_layer_spec_swaps_only_the_core_attention() -> None:
    spec, stock = local_layer_spec(), get_gpt_layer_local_spec(normalization="RMSNorm")
    attention, stock_attention = spec.submodules.self_attention, stock.submodules.self_attention
    assert attention.submodules.core_attention is SDPAttention
    assert stock_attention.submodules.core_attention is not SDPAttention
    assert attention.module is stock_attention.module
    for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(attention.submodules, name) == getattr(stock_attention.submodules, name)
    for name in ("input_layernorm", "pre_mlp_layernorm", "mlp"):
        assert getattr(spec.submodules, name) == getattr(stock.submodules, name)
