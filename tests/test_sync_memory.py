"""`synchronizer.sync_method: memory`: weights versions through /dev/shm to a local explorer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.explored_run import train_beside_explorer
from trinity_dagster.checkpoint import shm_weights
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_weights_version,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.checkpoint.publish import publish_weights
from trinity_dagster.checkpoint.shm_weights import (
    latest_shm_version,
    read_shm_weights,
    remove_shm_dir,
    shm_dir,
    shm_versions,
    write_shm_weights,
)
from trinity_dagster.config import ConfigError, TrinityConfig, check_inputs
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.testing import tiny_config

MEMORY = {"synchronizer": {"sync_method": "memory"}, "explorer": {"tasks_per_step": 2}}


@pytest.fixture
def memory_run(tmp_path: Path) -> Iterator[tuple[TrinityConfig, RunPaths]]:
    config, _ = tiny_config(tmp_path / "memory", MEMORY)
    paths = RunPaths.of(config.run_root)
    yield config, paths
    remove_shm_dir(paths)


def trained_tensors(paths: RunPaths, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Version 0's HF tensors, changed as a train step would change them."""
    generator = torch.Generator().manual_seed(1)
    initial = load_file(weights_dir(paths, 0) / "model.safetensors")
    return {
        name: (t + 0.01 * torch.randn(t.shape, generator=generator)).to(dtype)
        for name, t in initial.items()
    }


def uniform_tensors(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((3, 5 + i), value) for i in range(4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_sync_loads_the_same_weights_as_a_checkpoint_sync(
    tmp_path: Path, memory_run: tuple[TrinityConfig, RunPaths], dtype: torch.dtype
) -> None:
    disk_config, _ = tiny_config(tmp_path / "disk", {"explorer": {"tasks_per_step": 2}})
    disk_paths = RunPaths.of(disk_config.run_root)
    source = create_initial_model(disk_config, disk_paths)
    tensors = trained_tensors(disk_paths, dtype)
    hf_config = json.loads((source / "config.json").read_text())
    publish_weights(disk_paths, 1, tensors, hf_config, source)
    from_disk = Explorer(disk_config, disk_paths).policy(1).state_dict()

    config, paths = memory_run
    create_initial_model(config, paths)
    explorer = Explorer(config, paths)
    model = explorer.policy(0)
    write_shm_weights(paths, 1, tensors)
    assert explorer.policy(1) is model  # loaded in place, not from disk
    from_memory = model.state_dict()

    assert from_memory.keys() == from_disk.keys()
    for name, tensor in from_disk.items():
        assert torch.equal(from_memory[name], tensor), name
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0]  # nothing written per step


def test_a_failed_write_leaves_the_previous_version_whole(
    memory_run: tuple[TrinityConfig, RunPaths], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, paths = memory_run
    write_shm_weights(paths, 1, uniform_tensors(1.0))

    def half_write(path: Path, *args: Any) -> None:
        path.write_bytes(b"\0" * 100)
        raise OSError("no space left in /dev/shm")

    monkeypatch.setattr(shm_weights, "_write_region", half_write)
    with pytest.raises(OSError, match="no space"):
        write_shm_weights(paths, 2, uniform_tensors(2.0))

    assert latest_shm_version(paths) == 1
    assert shm_versions(paths) == [1]
    assert [p.name for p in shm_dir(paths).iterdir() if "global_step_2" in p.name] == []
    assert all(torch.equal(t, torch.full_like(t, 1.0)) for t in read_shm_weights(paths, 1).values())


def test_readers_see_only_whole_versions_while_versions_are_written(
    memory_run: tuple[TrinityConfig, RunPaths],
) -> None:
    _, paths = memory_run
    write_shm_weights(paths, 1, uniform_tensors(1.0))
    last = 40
    writer = threading.Thread(
        target=lambda: [write_shm_weights(paths, v, uniform_tensors(v)) for v in range(2, last + 1)]
    )
    writer.start()
    seen = []
    while writer.is_alive() or not seen or seen[-1] < last:
        version = latest_shm_version(paths)
        assert version is not None
        try:
            tensors = read_shm_weights(paths, version)
        except FileNotFoundError:
            continue  # superseded twice and pruned between the marker read and the open
        assert all(torch.equal(t, torch.full_like(t, float(version))) for t in tensors.values())
        seen.append(version)
    writer.join()
    assert seen == sorted(seen)  # the marker never moves backwards


def test_only_the_newest_two_regions_are_kept_and_all_go_with_the_service(
    memory_run: tuple[TrinityConfig, RunPaths],
) -> None:
    _, paths = memory_run
    for version in range(1, 6):
        write_shm_weights(paths, version, uniform_tensors(version))
    assert shm_versions(paths) == [4, 5]
    assert latest_shm_version(paths) == 5
    remove_shm_dir(paths)
    assert not shm_dir(paths).exists()


def test_shm_dirs_of_two_run_roots_differ(tmp_path: Path) -> None:
    assert shm_dir(RunPaths.of(tmp_path / "a")) != shm_dir(RunPaths.of(tmp_path / "b"))


def test_memory_sync_is_refused_where_it_cannot_reach_the_explorer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    multinode = {**MEMORY, "service": {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"}}
    with pytest.raises(ValueError, match=r"synchronizer\.sync_method.*rank 0 may land on any"):
        tiny_config(tmp_path, multinode)
    config, _ = tiny_config(tmp_path, MEMORY)  # the machine is probed at launch, not at load
    monkeypatch.setattr("trinity_dagster.config.SHM_ROOT", tmp_path / "no-shm")
    with pytest.raises(ConfigError, match=r"synchronizer\.sync_method.*Linux only"):
        check_inputs(config)


@pytest.mark.parametrize("explored", [3, 2], ids=["total_steps", "data_ends_early"])
def test_a_run_with_memory_sync_trains_to_the_end(
    memory_run: tuple[TrinityConfig, RunPaths], explored: int
) -> None:
    config, paths = memory_run
    run = train_beside_explorer(config, explored, lambda: shm_versions(paths))
    reason, versions, shm_held = run.reason, run.versions, run.while_up

    state = read_trainer_state(paths)
    assert state is not None and state.state == "finished"
    assert state.step == explored
    assert versions == {step: step - 1 for step in range(1, explored + 1)}  # all in memory
    assert shm_held == [explored - 1, explored]
    # nothing published per step; the final checkpoint's HF export is the last version on disk
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0]
    assert latest_weights_version(paths) == explored
    final = checkpoint_dir(paths, explored) / "huggingface"
    assert weights_dir(paths, explored) == final
    assert Explorer(config, paths).policy(explored) is not None
    assert not shm_dir(paths).exists()
    if explored < 3:
        assert "test data used up" in reason
