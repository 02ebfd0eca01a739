"""The sync rules, the explorer's weights version under sync_offset,
and that the checkpoint package stays importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trinity_dagster.checkpoint.rules import (
    explorer_waits_for_weights,
    explorer_weights_version,
    is_explorer_sync_point,
    need_sync,
)
from trinity_dagster.config import SynchronizerConfig


@pytest.mark.parametrize(
    ("step", "interval", "last_sync", "style", "requested", "expected"),
    [
        (4, 2, 0, "fixed", False, True),
        (3, 2, 0, "fixed", False, False),
        (4, 2, 4, "fixed", False, False),  # already synced at this step
        (1, 1, 0, "fixed", False, True),
        (6, 3, 3, "fixed", True, True),  # a request changes nothing in the fixed style
        (5, 3, 3, "fixed", True, False),
        (5, 3, 3, "explorer_driven", True, True),
        (5, 3, 3, "explorer_driven", False, False),
        (3, 3, 3, "explorer_driven", True, False),
        (4, 2, 0, "trainer_driven", False, True),  # the trainer publishes as under fixed
        (3, 2, 0, "trainer_driven", True, False),
        (4, 2, 0, "fully_async", False, True),
        (4, 2, 4, "fully_async", False, False),
    ],
)
def test_need_sync(step, interval, last_sync, style, requested, expected) -> None:
    got = need_sync(
        step,
        sync_interval=interval,
        last_sync_step=last_sync,
        style=style,
        explorer_requested=requested,
    )
    assert got is expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_interval": 0, "last_sync_step": 0}, "sync_interval must be >= 1"),
        ({"sync_interval": 1, "last_sync_step": -1}, "last_sync_step must be"),
        ({"sync_interval": 1, "last_sync_step": 0, "style": "dynamic"}, "unknown sync style"),
    ],
)
def test_need_sync_rejects_bad_input(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        need_sync(2, **kwargs)


@pytest.mark.parametrize(
    ("explore_step", "interval", "offset", "version"),
    [
        (1, 1, 0, 0),
        (2, 1, 0, 1),
        (5, 1, 0, 4),
        (2, 2, 0, 0),
        (3, 2, 0, 2),
        (4, 2, 0, 2),
        (5, 2, 0, 4),
        (2, 1, 1, 0),
        (3, 1, 1, 1),
        (4, 1, 1, 2),
        (3, 2, 1, 0),
        (4, 2, 1, 2),
        (5, 2, 1, 2),
        (6, 2, 1, 4),
    ],
)
def test_explorer_weights_version_table(explore_step, interval, offset, version) -> None:
    got = explorer_weights_version(explore_step, sync_interval=interval, sync_offset=offset)
    assert got == version


@pytest.mark.parametrize("interval", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_explorer_weights_version_matches_the_explorer_loop(interval, offset) -> None:
    # Trinity's explorer: after explore step E it syncs when E > offset and
    # (E - offset) % interval == 0, receiving the trainer's next synced version.
    syncs = 0
    for explore_step in range(1, 30):
        version = syncs * interval
        assert (
            explorer_weights_version(explore_step, sync_interval=interval, sync_offset=offset)
            == version
        )
        assert version >= explore_step - offset - interval
        if explore_step > offset and (explore_step - offset) % interval == 0:
            syncs += 1


@pytest.mark.parametrize(
    ("style", "method", "waits"),
    [
        ("fixed", "checkpoint", True),
        ("fixed", "nccl", True),
        ("trainer_driven", "checkpoint", True),  # Trinity's explorer pulls the next version
        ("trainer_driven", "memory", True),
        ("trainer_driven", "nccl", False),  # it takes a version only if one is ready
        ("fully_async", "nccl", False),
        ("fully_async", "checkpoint", False),
        ("explorer_driven", "checkpoint", False),  # it asks after its steps instead
    ],
)
def test_which_explorers_wait_for_weights(style: str, method: str, waits: bool) -> None:
    sync = SynchronizerConfig(sync_style=style, sync_method=method)
    assert explorer_waits_for_weights(sync) is waits


@pytest.mark.parametrize("interval", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_the_explorers_sync_points_are_where_its_weights_version_moves(interval, offset) -> None:
    sync = SynchronizerConfig(sync_interval=interval, sync_offset=offset)
    for step in range(2, 30):
        moved = explorer_weights_version(
            step, sync_interval=interval, sync_offset=offset
        ) != explorer_weights_version(step - 1, sync_interval=interval, sync_offset=offset)
        assert is_explorer_sync_point(step, sync) is moved, step
    assert not is_explorer_sync_point(1, sync)


def test_checkpoint_package_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import trinity_dagster.checkpoint.manager, trinity_dagster.checkpoint.publish\n"
        "import trinity_dagster.checkpoint.retention, trinity_dagster.checkpoint.rules\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
