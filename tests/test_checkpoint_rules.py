"""The sync/save decision table of DESIGN §5, the explorer's weights version under sync_offset,
and that the checkpoint package stays importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trinity_dagster.checkpoint.rules import (
    StepPlan,
    explorer_weights_version,
    need_hf_export,
    need_save,
    need_sync,
    plan_step,
)
from trinity_dagster.config import config_from_dict


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
    ("step", "save_interval", "total", "expected"),
    [
        (10, 10, 20, True),
        (5, 10, 20, False),
        (20, 10, 20, True),
        (7, 0, 20, False),
        (20, 0, 20, True),  # the final step always saves
        (19, 7, 19, True),
        (14, 7, 19, True),
        (0, 5, 10, False),
    ],
)
def test_need_save(step, save_interval, total, expected) -> None:
    assert need_save(step, save_interval=save_interval, total_steps=total) is expected


@pytest.mark.parametrize(
    ("mode", "step", "expected"),
    [("always", 3, True), ("last", 3, False), ("last", 9, True), ("never", 9, False)],
)
def test_need_hf_export(mode, step, expected) -> None:
    assert need_hf_export(step, save_hf_checkpoint=mode, total_steps=9) is expected


PLAN_COLUMNS = "step total save_interval save_hf method sync_interval last_sync"
PLAN_TABLE = [
    # inputs                                      save   hf     sync   serves block
    ((3, 10, 5, "last", "checkpoint", 1, 2), (False, False, True, False, False)),
    ((5, 10, 5, "last", "checkpoint", 1, 4), (True, True, True, True, False)),
    ((5, 10, 5, "never", "memory", 1, 4), (True, False, True, False, False)),
    ((5, 10, 5, "never", "checkpoint", 2, 4), (True, False, False, False, False)),
    ((10, 10, 0, "last", "checkpoint", 3, 9), (True, True, False, False, True)),
    ((10, 10, 0, "never", "checkpoint", 3, 9), (True, False, False, False, True)),
    ((4, 10, 2, "always", "nccl", 4, 0), (True, True, True, False, False)),
    ((6, 10, 2, "always", "checkpoint", 3, 6), (True, True, False, False, False)),
    ((7, 10, 2, "always", "checkpoint", 1, 6), (False, False, True, False, False)),
    ((10, 10, 4, "never", "checkpoint", 5, 5), (True, True, True, True, True)),
]


def _config(total, save_interval, save_hf, method, sync_interval, style="fixed"):
    return config_from_dict(
        {
            "trainer": {
                "total_steps": total,
                "save_interval": save_interval,
                "save_hf_checkpoint": save_hf,
            },
            "synchronizer": {
                "sync_method": method,
                "sync_interval": sync_interval,
                "sync_style": style,
            },
        }
    )


@pytest.mark.parametrize(("inputs", "expected"), PLAN_TABLE)
def test_plan_step_table(inputs, expected) -> None:
    step, total, save_interval, save_hf, method, sync_interval, last_sync = inputs
    config = _config(total, save_interval, save_hf, method, sync_interval)
    plan = plan_step(step, config, last_sync)
    save, hf, sync, serves, block = expected
    assert plan == StepPlan(step, save, hf, sync, serves, block)
    assert plan.publish is (sync and not serves)


def test_plan_step_explorer_driven_syncs_only_on_request() -> None:
    config = _config(10, 5, "never", "checkpoint", 1, style="explorer_driven")
    assert not plan_step(3, config, 1).sync
    asked = plan_step(3, config, 1, explorer_requested=True)
    assert asked.sync and asked.publish and not asked.save
    at_save = plan_step(5, config, 3, explorer_requested=True)
    assert at_save.save_serves_as_sync and at_save.save_hf


def test_plan_step_rejects_steps_outside_the_run() -> None:
    config = _config(10, 5, "never", "checkpoint", 1)
    for bad in (0, 11):
        with pytest.raises(ValueError, match=r"outside 1\.\.trainer\.total_steps \(10\)"):
            plan_step(bad, config, 0)


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


def test_checkpoint_package_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import trinity_dagster.checkpoint.manager, trinity_dagster.checkpoint.publish\n"
        "import trinity_dagster.checkpoint.retention, trinity_dagster.checkpoint.rules\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
