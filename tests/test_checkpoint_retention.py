"""Retention: counted from disk (survives restarts), never the newest complete checkpoint, one
being written, the one serving as published weights or the SFT model; partial leftovers are
cleaned."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from tests.support.checkpoint import TinyProvider, damage_checksum_only
from trinity_dagster.checkpoint.layout import (
    MANIFEST_FILE,
    checkpoint_dir,
    latest_checkpoint_step,
    scan_step_dirs,
    scratch_dir,
    set_latest_weights_version,
)
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.checkpoint.retention import prune_checkpoints
from trinity_dagster.config import config_from_dict
from trinity_dagster.paths import RunPaths


def _manager(
    tmp_path: Path, keep: int | None, provider: TinyProvider, sft_warmup_steps: int = 0
) -> CheckpointManager:
    trainer = {"max_checkpoints_to_keep": keep, "sft_warmup_steps": sft_warmup_steps}
    config = config_from_dict({"run_root": str(tmp_path), "trainer": trainer})
    return CheckpointManager(config, RunPaths.of(tmp_path), provider)


def _save_steps(manager: CheckpointManager, steps, *, hf: bool = False) -> None:
    for step in steps:
        while manager.provider.step < step:
            manager.provider.train()
        manager.save(step, hf=hf, block=True)


def _on_disk(paths: RunPaths) -> list[tuple[int, str]]:
    return [(d.step, d.kind) for d in scan_step_dirs(paths.checkpoints)]


def test_keeps_the_newest_k_across_a_restart(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    _save_steps(_manager(tmp_path, 2, provider), [1, 2, 3])
    assert _on_disk(paths) == [(2, "final"), (3, "final")]
    # a "restart": a new manager and provider resume and go on; the count comes from disk
    restarted = TinyProvider(seed=1)
    manager = _manager(tmp_path, 2, restarted)
    assert manager.resume() == 3
    _save_steps(manager, [4, 5])
    assert _on_disk(paths) == [(4, "final"), (5, "final")]
    assert latest_checkpoint_step(paths) == 5


def test_the_sft_model_is_kept_and_not_counted(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    _save_steps(_manager(tmp_path, 2, TinyProvider(), sft_warmup_steps=2), [1, 2, 3, 4, 5])
    assert _on_disk(paths) == [(2, "final"), (4, "final"), (5, "final")]
    # the retention schedule keeps it too; without the warm-up it goes like any other
    assert prune_checkpoints(paths, 2, keep_step=2) == []
    assert prune_checkpoints(paths, 2) == [checkpoint_dir(paths, 2)]


def test_partial_and_abandoned_dirs_older_than_the_newest_complete_are_removed(
    tmp_path: Path,
) -> None:
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    manager = _manager(tmp_path, 3, provider)
    _save_steps(manager, [1, 2])
    partial = checkpoint_dir(paths, 1)
    (partial / MANIFEST_FILE).unlink()  # e.g. damaged; counts as incomplete
    abandoned = scratch_dir(paths.checkpoints, 2)  # a crashed save of step 2
    abandoned.mkdir()
    trash = scratch_dir(paths.checkpoints, 0, "trash")  # a crashed deletion
    trash.mkdir()
    newer_partial = checkpoint_dir(paths, 9)
    newer_partial.mkdir()
    deleted = prune_checkpoints(paths, 3)
    assert set(deleted) == {partial, abandoned, trash}
    assert _on_disk(paths) == [(2, "final"), (9, "final")]


def test_never_deletes_the_newest_complete_or_a_save_in_progress(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    manager = _manager(tmp_path, 1, provider)
    _save_steps(manager, [1, 2])
    assert _on_disk(paths) == [(2, "final")]
    # the newest complete stays even if every newer directory is broken
    broken = checkpoint_dir(paths, 3)
    shutil.copytree(checkpoint_dir(paths, 2), broken)
    (broken / MANIFEST_FILE).unlink()
    assert prune_checkpoints(paths, 1) == []
    # a save being written (older than the newest complete) is left alone while pending
    shutil.rmtree(broken)
    gate = threading.Event()
    provider.step = 1  # pretend the engine was rolled back to step 1 and saves it again
    provider.gate = gate
    manager.save(1)
    provider.gate = None
    provider.step = 3
    manager.save(3, block=False)
    manager.wait(3)  # finalizing 3 runs retention while 1 is still being written
    assert (1, "tmp") in _on_disk(paths)
    gate.set()
    manager.wait_all()
    assert _on_disk(paths) == [(3, "final")]


def test_the_checkpoint_serving_as_published_weights_is_kept(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    manager = _manager(tmp_path, 1, provider)
    _save_steps(manager, [2], hf=True)
    set_latest_weights_version(paths, 2)  # step 2's huggingface/ is what explorers load
    _save_steps(manager, [3, 4])
    assert _on_disk(paths) == [(2, "final"), (4, "final")]


def test_keep_none_keeps_every_complete_checkpoint(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    _save_steps(_manager(tmp_path, None, TinyProvider()), [1, 2, 3, 4])
    assert _on_disk(paths) == [(s, "final") for s in (1, 2, 3, 4)]
    with pytest.raises(ValueError, match="max_checkpoints_to_keep must be >= 1 or None, got 0"):
        prune_checkpoints(paths, 0)


def test_a_damaged_newest_checkpoint_never_costs_the_older_good_one(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    _save_steps(_manager(tmp_path, None, provider), [1, 2])
    damage_checksum_only(checkpoint_dir(paths, 2))
    assert prune_checkpoints(paths, 1) == []
    assert _on_disk(paths) == [(1, "final"), (2, "final")]
    # once a newer checkpoint verifies, it is the one kept; the damaged one goes too
    _save_steps(_manager(tmp_path, 1, provider), [3])
    assert _on_disk(paths) == [(3, "final")]


def test_the_saving_manager_does_not_hash_its_own_checkpoints_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trinity_dagster.checkpoint import retention

    verified: list[Path] = []
    real_verify = retention.verify_checkpoint

    def spy(path: Path, *, checksums: bool):
        if checksums:
            verified.append(Path(path))
        return real_verify(path, checksums=checksums)

    monkeypatch.setattr(retention, "verify_checkpoint", spy)
    paths = RunPaths.of(tmp_path)
    provider = TinyProvider()
    _save_steps(_manager(tmp_path, None, provider), [1])  # written by another manager
    manager = _manager(tmp_path, 2, provider)
    _save_steps(manager, [2, 3, 4])
    manager.wait_all()
    assert _on_disk(paths) == [(3, "final"), (4, "final")]
    assert verified == []  # 2, 3 and 4 were hashed by the manager that wrote them
    # a checkpoint this manager did not write is verified before it is kept
    damage_checksum_only(checkpoint_dir(paths, 4))
    assert prune_checkpoints(paths, 1) == []
    assert verified == [checkpoint_dir(paths, 4), checkpoint_dir(paths, 3)]
