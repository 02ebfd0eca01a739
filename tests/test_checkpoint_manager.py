"""CheckpointManager with a real (tiny) torch provider: blocking and background saves, the
manifest and marker order, error propagation, re-saves, loading and falling back past damage."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.checkpoint import STATE_FILES, TinyProvider
from trinity_dagster.checkpoint import manager as manager_module
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    latest_weights_version,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.checkpoint.manager import (
    CheckpointManager,
    CheckpointSaveError,
    latest_complete,
)
from trinity_dagster.checkpoint.manifest import (
    MANIFEST_FILE,
    CorruptCheckpointError,
    build_manifest,
    verify_checkpoint,
)
from trinity_dagster.config import config_from_dict
from trinity_dagster.paths import RunPaths


def _setup(tmp_path: Path, keep: int | None = None):
    config = config_from_dict(
        {"run_root": str(tmp_path), "trainer": {"max_checkpoints_to_keep": keep}}
    )
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    return config, paths, provider, CheckpointManager(config, paths, provider)


def _train_to(provider: TinyProvider, step: int) -> None:
    while provider.step < step:
        provider.train()


def _gated_save(manager: CheckpointManager, provider: TinyProvider, step: int, **kwargs):
    gate = threading.Event()
    provider.gate = gate
    try:
        ticket = manager.save(step, **kwargs)
    finally:
        provider.gate = None
    return ticket, gate


def _poll_until_done(manager: CheckpointManager, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while manager.pending_steps():
        manager.poll()
        assert time.monotonic() < deadline, "background save did not finish"
        time.sleep(0.01)


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_blocking_save_is_complete_with_manifest_marker_and_sampler_state(tmp_path) -> None:
    config, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 2)
    ticket = manager.save(2, sampler_state={"cursor": 64}, hf=True, block=True)
    ckpt = checkpoint_dir(paths, 2)
    assert ticket.finished and ticket.directory == ckpt and manager.pending_steps() == []
    manifest = verify_checkpoint(ckpt)
    assert ticket.manifest == manifest
    assert manifest.step == 2 and manifest.sampler_state == {"cursor": 64}
    assert manifest.config_hash == config.resolved_hash()
    listed = {f.path for f in manifest.files}
    assert listed == set(STATE_FILES) | {"huggingface/config.json", "huggingface/model.safetensors"}
    assert latest_checkpoint_step(paths) == 2
    assert [d.kind for d in scan_step_dirs(paths.checkpoints)] == ["final"]


def test_background_save_completes_while_training_goes_on(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 1)
    at_save = provider.params()
    ticket, gate = _gated_save(manager, provider, 1, sampler_state={"cursor": 8})
    _train_to(provider, 3)  # the caller goes on training while step 1 is written
    assert manager.poll() == [] and manager.pending_steps() == [1]
    # nothing looks like a checkpoint of step 1 yet: no global_step_1, no manifest, no marker
    assert not checkpoint_dir(paths, 1).exists()
    (tmp,) = [d for d in scan_step_dirs(paths.checkpoints)]
    assert tmp.kind == "tmp" and not (tmp.path / MANIFEST_FILE).exists()
    assert latest_checkpoint_step(paths) is None
    gate.set()
    _poll_until_done(manager)
    assert ticket.finished and ticket.manifest.sampler_state == {"cursor": 8}
    assert latest_checkpoint_step(paths) == 1
    restored = TinyProvider(seed=5)
    CheckpointManager(manager.config, paths, restored).load(1)
    assert restored.step == 1
    assert all(torch.equal(restored.params()[k], v) for k, v in at_save.items())


def test_marker_never_moves_backwards(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 2)
    early, gate = _gated_save(manager, provider, 2)
    _train_to(provider, 4)
    late = manager.save(4)
    deadline = time.monotonic() + 10
    while not late.finished:  # step 4 finishes first; step 2 is still being written
        manager.poll()
        assert time.monotonic() < deadline
    assert manager.pending_steps() == [2] and latest_checkpoint_step(paths) == 4
    gate.set()
    manager.wait_all()
    assert early.finished and verify_checkpoint(early.directory).step == 2
    assert latest_checkpoint_step(paths) == 4


def test_background_error_propagates_on_poll_and_leaves_no_partial_dir(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 1)
    manager.save(1, block=True)
    _train_to(provider, 2)
    provider.fail_with = OSError("No space left on device (injected)")
    manager.save(2)
    provider.fail_with = None
    with pytest.raises(CheckpointSaveError, match=r"step 2 into .*global_step_2\.tmp-.*injected"):
        _poll_until_done(manager)
    assert manager.pending_steps() == []
    assert [d.path.name for d in scan_step_dirs(paths.checkpoints)] == ["global_step_1"]
    assert latest_checkpoint_step(paths) == 1


def test_background_error_propagates_on_wait_all(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 3)
    provider.fail_with = RuntimeError("writer crashed (injected)")
    manager.save(3)
    with pytest.raises(CheckpointSaveError, match="step 3") as info:
        manager.wait_all()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert latest_checkpoint_step(paths) is None and latest_complete(paths) is None


def test_resave_keeps_a_complete_checkpoint_and_replaces_a_partial_one(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 2)
    first = manager.save(2, block=True)
    mtimes = {p: p.stat().st_mtime_ns for p in first.directory.rglob("*")}
    again = manager.save(2, block=True)
    assert again.finished and again.manifest == first.manifest
    assert {p: p.stat().st_mtime_ns for p in first.directory.rglob("*")} == mtimes
    # asking for an HF export that the complete one lacks writes a new, complete one
    with_hf = manager.save(2, hf=True, block=True)
    assert "huggingface/config.json" in {f.path for f in with_hf.manifest.files}
    assert verify_checkpoint(first.directory) == with_hf.manifest
    # a partial global_step_2 (no manifest) is replaced by a fresh save
    (first.directory / MANIFEST_FILE).unlink()
    (first.directory / "model.pt").write_bytes(b"garbage")
    third = manager.save(2, block=True)
    assert verify_checkpoint(first.directory) == third.manifest
    assert [d.kind for d in scan_step_dirs(paths.checkpoints)] == ["final"]


def test_save_rejects_bad_input(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 2)
    with pytest.raises(ValueError, match="step 3: the engine is at step 2"):
        manager.save(3)
    with pytest.raises(ValueError, match="must export HF weights"):
        manager.save(2, serves_as_sync=True)
    with pytest.raises(ValueError, match="sampler_state of step 2 is not JSON-serializable"):
        manager.save(2, sampler_state={"cursor": object()})
    assert scan_step_dirs(paths.checkpoints) == []  # refused before anything was written
    _, gate = _gated_save(manager, provider, 2)
    with pytest.raises(ValueError, match="a save of step 2 is already in progress"):
        manager.save(2)
    gate.set()
    manager.wait_all()


def test_files_are_hashed_on_a_helper_thread_and_the_manifest_comes_after(
    tmp_path, monkeypatch
) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 1)
    hashing, release, threads = threading.Event(), threading.Event(), []

    def slow_build_manifest(*args, **kwargs):
        threads.append(threading.current_thread())
        hashing.set()
        assert release.wait(10), "the test never released the hashing"
        return build_manifest(*args, **kwargs)

    monkeypatch.setattr(manager_module, "build_manifest", slow_build_manifest)
    ticket = manager.save(1, sampler_state={"cursor": 8})
    deadline = time.monotonic() + 10
    while not hashing.is_set():  # hashing starts at the first poll after the state is written
        assert manager.poll() == [] and time.monotonic() < deadline
        time.sleep(0.01)
    assert threads[0] is not threading.main_thread()
    # being hashed: polling does not wait for it and nothing is installed yet
    assert manager.poll() == [] and manager.pending_steps() == [1]
    assert not checkpoint_dir(paths, 1).exists() and latest_checkpoint_step(paths) is None
    (tmp,) = scan_step_dirs(paths.checkpoints)
    assert tmp.kind == "tmp" and not (tmp.path / MANIFEST_FILE).exists()
    release.set()
    _poll_until_done(manager)
    assert ticket.finished and latest_checkpoint_step(paths) == 1
    assert verify_checkpoint(checkpoint_dir(paths, 1)).sampler_state == {"cursor": 8}


def test_hashing_error_propagates_and_leaves_no_partial_dir(tmp_path, monkeypatch) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 1)

    def failing_build_manifest(ckpt_dir, **kwargs):
        raise OSError(f"{ckpt_dir}: disk went away")

    monkeypatch.setattr(manager_module, "build_manifest", failing_build_manifest)
    manager.save(1)
    with pytest.raises(CheckpointSaveError, match=r"step 1 .* failed: .*disk went away"):
        manager.wait(1)
    assert manager.pending_steps() == [] and scan_step_dirs(paths.checkpoints) == []
    assert latest_checkpoint_step(paths) is None


def test_save_serving_as_sync_publishes_the_hf_export(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    _train_to(provider, 4)
    _, gate = _gated_save(manager, provider, 4, hf=True, serves_as_sync=True)
    assert latest_weights_version(paths) is None  # not before the checkpoint is complete
    gate.set()
    manager.wait(4)
    assert latest_weights_version(paths) == 4
    assert weights_dir(paths, 4) == checkpoint_dir(paths, 4) / "huggingface"


def test_load_falls_back_past_damaged_checkpoints(tmp_path, caplog) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    expected = {}
    for step in (1, 2, 3):
        _train_to(provider, step)
        expected[step] = provider.params()
        manager.save(step, sampler_state={"cursor": step * 10}, block=True)
    _flip_byte(checkpoint_dir(paths, 3) / "model.pt")
    (checkpoint_dir(paths, 2) / "optim.pt").unlink()

    with pytest.raises(CorruptCheckpointError, match=r"global_step_3/model\.pt: sha256"):
        manager.load(3)
    fresh = TinyProvider(seed=7)
    with caplog.at_level(logging.WARNING):
        manifest = CheckpointManager(manager.config, paths, fresh).load()
    assert manifest.step == 1 and manifest.sampler_state == {"cursor": 10}
    assert fresh.step == 1
    assert all(torch.equal(fresh.params()[k], v) for k, v in expected[1].items())
    warned = caplog.text
    assert "global_step_3" in warned and "global_step_2" in warned


def test_resume_without_checkpoints_is_a_fresh_start(tmp_path) -> None:
    _, paths, provider, manager = _setup(tmp_path)
    assert manager.resume() is None and provider.step == 0
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        manager.load()
    _train_to(provider, 2)
    manager.save(2, block=True)
    other = TinyProvider(seed=3)
    assert CheckpointManager(manager.config, paths, other).resume() == 2
    assert other.step == 2


def test_retention_runs_off_the_loop_and_its_error_is_raised(tmp_path, monkeypatch) -> None:
    _, paths, provider, manager = _setup(tmp_path, keep=1)
    for step in (1, 2):
        _train_to(provider, step)
        manager.save(step, block=True)
    assert [d.step for d in scan_step_dirs(paths.checkpoints)] == [2]  # pruned, waited for
    threads = []

    def failing_prune(*args, **kwargs):
        threads.append(threading.current_thread())
        raise OSError("retention could not delete global_step_2")

    monkeypatch.setattr(manager_module, "prune_checkpoints", failing_prune)
    _train_to(provider, 3)
    manager.save(3)
    with pytest.raises(OSError, match="could not delete global_step_2"):
        manager.wait_all()
    assert threads[0] is not threading.main_thread()
    assert latest_checkpoint_step(paths) == 3 and verify_checkpoint(checkpoint_dir(paths, 3))
