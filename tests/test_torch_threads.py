"""How the built-in explorer and the engine ranks share one machine's cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from trinity_dagster.testing import tiny_config
from trinity_dagster.torch_threads import engine_torch_threads, explorer_torch_threads


@pytest.mark.parametrize(
    ("sync", "threads", "expected"),
    [
        ({}, None, 7),  # fixed, interval 1, offset 0: it runs only while training waits,
        # beside the trainer's bookkeeping of the step before
        ({"sync_offset": 1}, None, 4),  # beside a training step: half the cores
        ({"sync_interval": 2}, None, 4),
        ({"sync_style": "fully_async"}, None, 4),
        ({"sync_style": "explorer_driven"}, None, 4),
        ({"sync_offset": 1}, 3, 3),  # explorer.torch_threads decides when set
        ({}, 2, 2),
    ],
)
def test_explorer_torch_threads_leave_cores_to_the_engine_it_runs_beside(
    tmp_path: Path, sync: dict, threads: int | None, expected: int
) -> None:
    config, _ = tiny_config(
        tmp_path, {"synchronizer": sync, "explorer": {"torch_threads": threads}}
    )
    assert explorer_torch_threads(config, cores=8) == expected
    assert explorer_torch_threads(config, cores=1) == (threads or 1)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 8),  # the explorer only runs while training waits: all cores
        ({"synchronizer": {"sync_offset": 1}}, 4),  # the half the explorer leaves
        ({"synchronizer": {"sync_interval": 2}}, 4),
        ({"synchronizer": {"sync_offset": 1}, "explorer": {"torch_threads": 6}}, 2),
        ({"synchronizer": {"sync_offset": 1}, "explorer": {"torch_threads": 8}}, 1),
        ({"synchronizer": {"sync_offset": 1}, "dagster": {"builtin_explorer": False}}, 8),
        ({"megatron": {"tensor_model_parallel_size": 2}}, 4),  # two ranks share the cores
        ({"megatron": {"tensor_model_parallel_size": 2}, "synchronizer": {"sync_offset": 1}}, 2),
    ],
)
def test_engine_torch_threads_take_the_cores_the_explorer_leaves(
    tmp_path: Path, overrides: dict, expected: int
) -> None:
    config, _ = tiny_config(tmp_path, overrides)
    assert engine_torch_threads(config, cores=8) == expected
    assert engine_torch_threads(config, cores=1) == 1  # at least one a rank


def test_trainer_torch_threads_decide_when_set(tmp_path: Path) -> None:
    config, _ = tiny_config(
        tmp_path, {"synchronizer": {"sync_offset": 1}, "trainer": {"torch_threads": 3}}
    )
    assert engine_torch_threads(config, cores=8) == engine_torch_threads(config, cores=1) == 3


def test_an_engine_on_other_machines_than_the_explorer_keeps_its_cores(tmp_path: Path) -> None:
    config, _ = tiny_config(
        tmp_path,
        {
            "synchronizer": {"sync_offset": 1},
            "megatron": {"data_parallel_size": 2},
            "service": {
                "nnodes": 2,
                "rdzv_endpoint": "10.0.0.2:29400",
                "allow_non_loopback": True,
            },
        },
    )
    assert engine_torch_threads(config, cores=8) == 8  # one rank a node, alone on it
