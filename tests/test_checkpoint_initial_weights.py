"""Weights version 0: built from config (or copied from model.path), loadable by transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import (
    latest_weights_version,
    published_weights_dir,
    set_latest_weights_version,
)
from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.paths import RunPaths
from trinity_dagster.tokenizer import CHARSET, SPECIAL_TOKENS

SHAPES = {
    "model.hidden_size": 32,
    "model.num_layers": 3,
    "model.num_attention_heads": 4,
    "model.num_query_groups": 1,
    "model.ffn_hidden_size": 48,
    "model.max_position_embeddings": 40,
    "model.rope_theta": 5000.0,
    "model.rms_norm_eps": 1e-5,
    "model.tie_word_embeddings": False,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(tmp_path: Path, name: str = "run", **overrides: object) -> tuple[TrinityConfig, RunPaths]:
    cfg = load_config(None, {"run_root": str(tmp_path / name), **overrides})
    return cfg, RunPaths.of(cfg.run_root)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_tiny_model_has_the_configured_shapes_and_loads(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path, **SHAPES)
    out = create_initial_model(cfg, paths)
    assert out == published_weights_dir(paths, 0)
    assert latest_weights_version(paths) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    hf = model.config
    assert hf.model_type == "llama"
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (32, 3, 4)
    assert (hf.num_key_value_heads, hf.intermediate_size) == (1, 48)
    assert hf.max_position_embeddings == 40 and hf.rms_norm_eps == 1e-5
    assert hf.rope_parameters["rope_theta"] == 5000.0
    assert hf.tie_word_embeddings is False
    assert hf.vocab_size == len(SPECIAL_TOKENS) + len(CHARSET)
    assert model.dtype == torch.float32
    assert len(model.model.layers) == 3
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)  # 1 group x head_dim 8
    tokenizer = AutoTokenizer.from_pretrained(str(paths.tokenizer))
    assert len(tokenizer) == hf.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == tokenizer.get_vocab()
    logits = model(torch.tensor([tokenizer("1+2=")["input_ids"]])).logits
    assert logits.shape == (1, 5, hf.vocab_size) and torch.isfinite(logits).all()


def test_weights_are_seeded_by_trainer_seed(tmp_path: Path) -> None:
    a = weights(create_initial_model(*make(tmp_path, "a", **{"trainer.seed": 5})))
    b = weights(create_initial_model(*make(tmp_path, "b", **{"trainer.seed": 5})))
    c = weights(create_initial_model(*make(tmp_path, "c", **{"trainer.seed": 6})))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_vocab_size_from_config(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path, **{"model.vocab_size": 128})
    out = create_initial_model(cfg, paths)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 128
    cfg, paths = make(tmp_path, "small", **{"model.vocab_size": 10})
    with pytest.raises(ValueError, match=r"model.vocab_size \(10\) is smaller"):
        create_initial_model(cfg, paths)
    assert list(paths.weights.iterdir()) == []  # nothing half-written is left


def test_idempotent_keeps_version_0_and_rebuilds_an_incomplete_one(tmp_path: Path) -> None:
    cfg, paths = make(tmp_path)
    out = create_initial_model(cfg, paths)
    before = (out / "model.safetensors").stat().st_mtime_ns
    set_latest_weights_version(paths, 3)
    cfg.trainer.seed = 99  # would give other weights if it rebuilt
    assert create_initial_model(cfg, paths) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert latest_weights_version(paths) == 3  # never moved back
    (out / "model.safetensors").unlink()
    create_initial_model(cfg, paths)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in paths.weights.iterdir()) == ["global_step_0"]


def test_model_path_is_copied_and_verified(tmp_path: Path) -> None:
    source = create_initial_model(*make(tmp_path, "source", **{"trainer.seed": 11}))
    cfg, paths = make(tmp_path, "copy", **{"model.path": str(source)})
    out = create_initial_model(cfg, paths)
    a, b = weights(source), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (paths.tokenizer / "tokenizer.json").is_file()
    assert latest_weights_version(paths) == 0


def test_model_path_errors_name_the_problem(tmp_path: Path) -> None:
    source = create_initial_model(*make(tmp_path, "source"))
    bad = tmp_path / "gpt2"
    shutil.copytree(source, bad)
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    cases = {
        str(tmp_path / "missing"): "no config.json",
        str(bad): r"model_type 'gpt2' is not supported",
    }
    for index, (path, message) in enumerate(cases.items()):
        cfg, paths = make(tmp_path, f"r{index}", **{"model.path": path})
        with pytest.raises((ValueError, FileNotFoundError), match=message) as info:
            create_initial_model(cfg, paths)
        assert path in str(info.value)
        assert latest_weights_version(paths) is None
    no_weights = tmp_path / "no_weights"
    shutil.copytree(source, no_weights)
    (no_weights / "model.safetensors").unlink()
    cfg, paths = make(tmp_path, "r9", **{"model.path": str(no_weights)})
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        create_initial_model(cfg, paths)
