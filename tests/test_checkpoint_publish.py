"""Weight publishing: an HF directory transformers loads with the same logits, the atomic
switch of versions (a crash mid-write changes nothing visible), sync from a checkpoint, pruning."""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trinity_dagster.checkpoint import shared_files
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_weights_version,
    published_weights_dir,
    scan_step_dirs,
    scratch_dir,
    weights_dir,
)
from trinity_dagster.checkpoint.manifest import build_manifest, write_manifest
from trinity_dagster.checkpoint.publish import (
    prune_published,
    publish_weights,
    record_sync_from_checkpoint,
)
from trinity_dagster.checkpoint.weights_holds import held_versions, hold_weights
from trinity_dagster.files import write_file_synced
from trinity_dagster.handoff.wakeup import EXPLORER, Wakeup
from trinity_dagster.paths import RunPaths


def _tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _tokenizer_dir(root: Path) -> Path:
    tok = root / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    (tok / "config.json").write_text('{"not": "copied"}')
    return tok


def _publish(paths: RunPaths, step: int, model: LlamaForCausalLM, tok: Path | None = None):
    return publish_weights(paths, step, model.state_dict(), model.config.to_dict(), tok)


def test_published_weights_load_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    model = _tiny_llama(seed=0)
    tok = _tokenizer_dir(tmp_path)
    out = _publish(paths, 3, model, tok)
    assert out == published_weights_dir(paths, 3) == weights_dir(paths, 3)
    assert latest_weights_version(paths) == 3
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)


def test_published_weights_carry_the_generation_config_and_the_dtype(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    model = _tiny_llama(seed=0).to(torch.bfloat16)
    source = _tokenizer_dir(tmp_path)
    (source / "generation_config.json").write_text('{"eos_token_id": 2}')
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    out = publish_weights(paths, 1, model.state_dict(), config, source)
    assert (out / "generation_config.json").read_text() == '{"eos_token_id": 2}'
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_crash_mid_write_leaves_the_old_version_resolvable(tmp_path: Path, monkeypatch) -> None:
    paths = RunPaths.of(tmp_path)
    old = _publish(paths, 1, _tiny_llama(seed=1))
    old_bytes = (old / "model.safetensors").read_bytes()
    real_save = safetensors.torch.save_file

    def crash_after_writing(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise OSError("power cut mid-write (injected)")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_after_writing)
    with pytest.raises(OSError, match="injected"):
        _publish(paths, 2, _tiny_llama(seed=2))
    assert latest_weights_version(paths) == 1
    assert weights_dir(paths, 1) == old
    assert (old / "model.safetensors").read_bytes() == old_bytes
    assert [(d.step, d.kind) for d in scan_step_dirs(paths.weights)] == [(1, "final")]
    with pytest.raises(FileNotFoundError, match="no weights of version 2"):
        weights_dir(paths, 2)


def test_a_published_directory_holds_its_files_alone_readable_by_all(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    out = _publish(paths, 1, _tiny_llama(seed=1), _tokenizer_dir(tmp_path))
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert {stat.S_IMODE((out / name).stat().st_mode) for name in files} == {0o644}
    assert json.loads((out / "tokenizer.json").read_text()) == {"version": "1.0"}
    with pytest.raises(FileExistsError):
        write_file_synced(out / "config.json", lambda path: path.write_text("{}"))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 32


SHARED = ["config.json", "tokenizer.json", "tokenizer_config.json"]


def test_versions_share_one_stored_copy_of_their_config_and_tokenizer(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    tok = _tokenizer_dir(tmp_path)
    first, second = (_publish(paths, v, _tiny_llama(seed=v), tok) for v in (1, 2))
    third = _publish(paths, 3, _tiny_llama(seed=3), tok)
    stored = {p.stat().st_ino: p for p in paths.weights_shared.iterdir()}
    for name in SHARED:
        inodes = {(d / name).stat().st_ino for d in (first, second, third)}
        assert len(inodes) == 1 and inodes <= stored.keys(), name
        assert (third / name).read_bytes() == stored[inodes.pop()].read_bytes()
    assert (third / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    weights = {(d / "model.safetensors").stat().st_ino for d in (first, second, third)}
    assert len(weights) == 3  # the weights themselves are each version's own
    prune_published(paths, keep=1)
    assert [d.step for d in scan_step_dirs(paths.weights)] == [3]
    assert len(list(paths.weights_shared.iterdir())) == len(SHARED)
    loaded = AutoModelForCausalLM.from_pretrained(weights_dir(paths, 3))
    assert loaded.config.vocab_size == 32


def test_a_changed_tokenizer_file_is_stored_anew(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    tok = _tokenizer_dir(tmp_path)
    before = _publish(paths, 1, _tiny_llama(seed=1), tok)
    (tok / "tokenizer.json").write_text('{"version": "2.0.1"}')
    after = _publish(paths, 2, _tiny_llama(seed=1), tok)
    assert json.loads((before / "tokenizer.json").read_text()) == {"version": "1.0"}
    assert json.loads((after / "tokenizer.json").read_text()) == {"version": "2.0.1"}


def test_a_damaged_stored_copy_is_replaced_not_linked(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    tok = _tokenizer_dir(tmp_path)
    text = (tok / "tokenizer.json").read_bytes()
    damaged = paths.weights_shared / hashlib.sha256(text).hexdigest()
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(text[:5])  # e.g. torn by a crash of a tool that wrote it in place
    out = _publish(paths, 1, _tiny_llama(seed=1), tok)
    assert (out / "tokenizer.json").read_bytes() == text == damaged.read_bytes()


def test_without_hard_links_each_version_writes_its_own_files(tmp_path: Path, monkeypatch) -> None:
    def refused(source, target):
        raise OSError(errno.EPERM, "hard links not allowed here (injected)")

    monkeypatch.setattr(shared_files.os, "link", refused)
    paths = RunPaths.of(tmp_path)
    out = _publish(paths, 1, _tiny_llama(seed=1), _tokenizer_dir(tmp_path))
    for name in SHARED:
        assert (out / name).stat().st_nlink == 1, name
    assert json.loads((out / "tokenizer.json").read_text()) == {"version": "1.0"}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 32


def test_republish_replaces_and_the_marker_never_moves_back(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    _publish(paths, 4, _tiny_llama(seed=1))
    second = _tiny_llama(seed=2)
    _publish(paths, 4, second)
    stored = safetensors.torch.load_file(published_weights_dir(paths, 4) / "model.safetensors")
    assert torch.equal(stored["model.norm.weight"], second.state_dict()["model.norm.weight"])
    assert torch.equal(
        stored["model.layers.0.mlp.up_proj.weight"],
        second.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    _publish(paths, 2, second)  # an older version published late
    assert latest_weights_version(paths) == 4


def test_publish_rejects_bad_input(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    with pytest.raises(TypeError, match=r"entry 'w' must map a str to a torch\.Tensor, got list"):
        publish_weights(paths, 1, {"w": [1.0]}, {}, None)
    with pytest.raises(ValueError, match="no tensors given"):
        publish_weights(paths, 1, {}, {}, None)
    with pytest.raises(FileNotFoundError, match=r"source directory .*nowhere of the tokenizer"):
        publish_weights(paths, 1, {"w": torch.ones(2)}, {}, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="hf_config is not JSON-serializable"):
        publish_weights(paths, 1, {"w": torch.ones(2)}, {"x": object()}, None)
    assert not paths.weights.exists() or list(paths.weights.iterdir()) == []
    assert latest_weights_version(paths) is None


def test_record_sync_from_checkpoint_points_explorers_at_its_hf_export(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    ckpt = checkpoint_dir(paths, 6)
    (ckpt / "huggingface").mkdir(parents=True)
    (ckpt / "huggingface" / "config.json").write_text("{}")
    (ckpt / "state.bin").write_bytes(b"x" * 10)
    write_manifest(ckpt, build_manifest(ckpt, step=6, config_hash="h", sampler_state={}))
    assert record_sync_from_checkpoint(paths, 6) == ckpt / "huggingface"
    assert latest_weights_version(paths) == 6 and weights_dir(paths, 6) == ckpt / "huggingface"

    bare = checkpoint_dir(paths, 8)
    bare.mkdir()
    (bare / "state.bin").write_bytes(b"y")
    write_manifest(bare, build_manifest(bare, step=8, config_hash="h", sampler_state={}))
    with pytest.raises(FileNotFoundError, match=r"global_step_8 has no huggingface/config\.json"):
        record_sync_from_checkpoint(paths, 8)
    assert latest_weights_version(paths) == 6


def test_prune_published_keeps_the_last_k_the_current_and_version_zero(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    tensors = {"w": torch.arange(4.0)}
    for version in (0, 1, 2, 3, 4, 5):
        publish_weights(paths, version, tensors, {}, None)
    newer = published_weights_dir(paths, 7)  # written, marker not yet moved
    newer.mkdir()
    stale_tmp = scratch_dir(paths.weights, 3)
    stale_tmp.mkdir()
    deleted = prune_published(paths, keep=2)
    assert set(deleted) == {published_weights_dir(paths, v) for v in (1, 2, 3)} | {stale_tmp}
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0, 4, 5, 7]
    assert weights_dir(paths, latest_weights_version(paths)) == published_weights_dir(paths, 5)
    with pytest.raises(ValueError, match="keep_synced_weights must be >= 1"):
        prune_published(paths, keep=0)


def test_a_held_version_is_not_pruned_until_its_reader_lets_go(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    tensors = {"w": torch.arange(4.0)}
    for version in (0, 1, 2, 3):
        publish_weights(paths, version, tensors, {}, None)
    with hold_weights(paths, 1):
        assert held_versions(paths) == {1}
        deleted = prune_published(paths, keep=1)
        assert deleted == [published_weights_dir(paths, 2)]
        assert weights_dir(paths, 1) == published_weights_dir(paths, 1)  # still readable
    assert held_versions(paths) == set()
    assert prune_published(paths, keep=1) == [published_weights_dir(paths, 1)]


def test_a_hold_of_a_dead_reader_does_not_count(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    holds = paths.weights / "holds"
    holds.mkdir(parents=True)
    dead = {"version": 2, "pid": 2**22 + 12345, "host": socket.gethostname()}
    (holds / "2-dead.json").write_text(json.dumps(dead))
    assert held_versions(paths) == set()
    assert not (holds / "2-dead.json").exists(), "a dead reader's hold is removed"


def test_explorers_waiting_for_weights_are_woken_when_the_marker_moves(
    short_tmp_path: Path,
) -> None:
    paths = RunPaths.of(short_tmp_path)
    explorer = Wakeup(paths.wakeup, EXPLORER, "builtin")
    try:
        threading.Timer(0.2, _publish, args=(paths, 1, _tiny_llama(seed=1))).start()
        started = time.monotonic()
        explorer.wait(30.0)
        assert time.monotonic() - started < 10.0  # woken by the publish, not timed out
        assert latest_weights_version(paths) == 1
        _publish(paths, 1, _tiny_llama(seed=2))  # a re-publish does not move the marker
        started = time.monotonic()
        explorer.wait(0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        explorer.close()
