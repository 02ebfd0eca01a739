"""Which weights version an explore step takes under each of Trinity-RFT's sync styles, and
whether it waits for it (the built-in explorer's side of `synchronizer.sync_style`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trinity_dagster.explorer.loop import ExplorerLoop
from trinity_dagster.testing import tiny_config


class Published:
    """The newest weights version the explorer can load, as a test sets it."""

    def __init__(self, version: int) -> None:
        self.version = version

    def __call__(self) -> int:
        return self.version


def explorer_loop(tmp_path: Path, newest: Published, **sync: object) -> ExplorerLoop:
    config, _ = tiny_config(tmp_path, {"synchronizer": {"sync_timeout": 0.3, **sync}})
    loop = ExplorerLoop(config)
    loop._latest_version = newest  # what the trainer has published (or announced) so far
    return loop


@pytest.mark.parametrize("method", ["checkpoint", "nccl"])
def test_fixed_waits_for_the_version_its_step_needs(tmp_path: Path, method: str) -> None:
    newest = Published(1)
    loop = explorer_loop(tmp_path, newest, sync_style="fixed", sync_method=method)
    with pytest.raises(TimeoutError, match="explore step 3 needs weights version >= 2"):
        loop._wait_for_weights(3)
    newest.version = 5
    assert loop._wait_for_weights(3) == 5  # at least the one needed: the newest


def test_trainer_driven_over_files_waits_as_fixed_does(tmp_path: Path) -> None:
    loop = explorer_loop(tmp_path, Published(1), sync_style="trainer_driven")
    with pytest.raises(TimeoutError, match="explore step 3 needs weights version >= 2"):
        loop._wait_for_weights(3)


def test_trainer_driven_over_nccl_takes_what_is_ready_at_its_sync_points(tmp_path: Path) -> None:
    newest = Published(0)
    loop = explorer_loop(
        tmp_path, newest, sync_style="trainer_driven", sync_method="nccl", sync_interval=2
    )
    assert loop._wait_for_weights(3) == 0  # a sync point, nothing newer: no wait
    loop._held = 0
    newest.version = 4
    assert loop._wait_for_weights(4) == 0  # not a sync point: it keeps what it holds
    assert loop._wait_for_weights(5) == 4  # the next sync point takes the newest


def test_fully_async_never_waits_and_takes_the_newest(tmp_path: Path) -> None:
    newest = Published(1)
    loop = explorer_loop(tmp_path, newest, sync_style="fully_async")
    assert loop._wait_for_weights(40) == 1  # fixed would wait for version 39
    loop._held = 1
    newest.version = 3
    assert loop._wait_for_weights(41) == 3


@pytest.mark.parametrize(
    "style", ["fixed", "trainer_driven", "fully_async", "explorer_driven"], ids=str
)
def test_no_style_steps_back_to_weights_older_than_those_held(tmp_path: Path, style: str) -> None:
    """A killed engine service took version 4, which the explorer holds, with it: the newest
    version is 0 again until the restarted service holds 4 again."""
    newest = Published(0)
    loop = explorer_loop(tmp_path, newest, sync_style=style, sync_method="nccl")
    loop._held = 4
    with pytest.raises(TimeoutError, match="explore step 5 needs weights version >= 4"):
        loop._wait_for_weights(5)
    newest.version = 4
    assert loop._wait_for_weights(5) == 4
