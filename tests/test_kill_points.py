"""Kill points: engine rank 0 dies (or hangs) at each crash window of a short training.

Each case runs the real trainer loop (`Trainer` + `ServiceEngineWrapper`) over 4 steps with
the fault armed (`TRINITY_DAGSTER_FAULT`, `trinity_dagster.faults`). The schedule
(`sync_interval` 1, `save_interval` 2) publishes weights 1 and 3, saves checkpoint 2 in the
background serving as its sync, and ends with the blocking final save 4 serving as the sync.
The training must finish by itself with the uninterrupted run's final weights, bit for bit,
each step reported once with the uninterrupted run's losses. Under PPO the critic's final
weights must match too, after kills during its warm-up (steps 1-2 train only the critic).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    latest_weights_version,
    scan_step_dirs,
)
from trinity_dagster.checkpoint.shm_weights import remove_shm_dir
from trinity_dagster.commands.convert_cmd import export_checkpoint
from trinity_dagster.config import TrinityConfig
from trinity_dagster.faults import ENV, fired_path
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.testing import fill_buffer, merge, tiny_config
from trinity_dagster.trainer.engine_wrapper import ServiceEngineWrapper
from trinity_dagster.trainer.trainer import Trainer, TrainerHook

pytestmark = pytest.mark.slow

STEPS = 4
SCHEDULE: dict[str, Any] = {"trainer": {"total_steps": STEPS, "save_interval": 2}}
MEMORY: dict[str, Any] = {"synchronizer": {"sync_method": "memory"}}
PPO: dict[str, Any] = {"algorithm": {"algorithm_type": "ppo"}, "critic": {"warmup_steps": 2}}
HANG_TIMEOUT_S = 8.0


class StepLog(TrainerHook):
    """The steps the trainer loop reported, with their losses, in order."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: dict[int, tuple[float | None, float | None]] = {}

    def on_step(self, step: int, record: dict[str, Any], metrics: dict[str, Any]) -> None:
        self.steps.append(step)
        losses = record["metrics"]
        self.losses[step] = (losses.get("actor/pg_loss"), losses.get("critic/vf_loss"))


@dataclass(frozen=True)
class Outcome:
    """What a finished training left: final weights and what the loop reported."""

    weights: dict[str, torch.Tensor]
    log: StepLog
    paths: RunPaths

    def critic(self) -> dict[str, torch.Tensor]:
        """The final checkpoint's critic, exported to HF format."""
        out = self.paths.root / "critic_hf"
        export_checkpoint(checkpoint_dir(self.paths, STEPS), out, critic=True)
        return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root with the experiences and the initial model, copied by every case."""
    base = tmp_path_factory.mktemp("seed")
    config, _ = tiny_config(base, SCHEDULE)
    fill_buffer(config, steps=STEPS)
    create_initial_model(config, RunPaths.of(config.run_root))
    return Path(config.run_root)


def train(seed_run: Path, where: Path, extra: dict[str, Any]) -> Outcome:
    """Train all steps through the engine service in a copy of the seed run."""
    config, _ = tiny_config(where, merge(SCHEDULE, extra))
    paths = RunPaths.of(config.run_root)
    shutil.copytree(seed_run, paths.root)
    log = StepLog()
    try:
        asyncio.run(Trainer(config, engine=ServiceEngineWrapper(config), hook=log).run())
    finally:
        stop_service(paths)
        remove_shm_dir(paths)
    assert _finished(config), read_trainer_state(paths)
    final = checkpoint_dir(paths, STEPS) / "huggingface" / "model.safetensors"
    return Outcome(load_file(final), log, paths)


def _finished(config: TrinityConfig) -> bool:
    state = read_trainer_state(RunPaths.of(config.run_root))
    return state is not None and state.state == "finished" and state.step == STEPS


@pytest.fixture(scope="module")
def reference(seed_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The uninterrupted run, once per module."""
    return train(seed_run, tmp_path_factory.mktemp("reference"), {})


def assert_same_training(got: Outcome, expected: Outcome) -> None:
    """Bit-identical final weights; every step reported once, with the reference's loss."""
    assert got.weights.keys() == expected.weights.keys()
    worst = max((got.weights[k] - t).abs().max().item() for k, t in expected.weights.items())
    assert worst == 0.0, f"max |dw| = {worst}"
    assert got.log.steps == list(range(1, STEPS + 1))
    assert got.log.losses == expected.log.losses
    assert latest_checkpoint_step(got.paths) == STEPS
    for parent in (got.paths.checkpoints, got.paths.weights):
        assert [d.path.name for d in scan_step_dirs(parent) if d.kind != "final"] == []


def fired(paths: RunPaths) -> dict[str, Any]:
    """The record of the fault that fired in this run (fails if none did)."""
    assert fired_path(paths).is_file(), "the fault never fired: its window was not reached"
    return json.loads(fired_path(paths).read_text())


CASES = {
    "train_forward": ("train_forward:3", {}),
    "train_backward": ("train_backward:3", {}),
    "optimizer_step": ("optimizer_step:3", {}),
    "checkpoint_write": ("checkpoint_write:4", {}),  # the blocking final save
    "checkpoint_renamed": ("checkpoint_renamed:2", {}),  # a background save serving as sync
    "weights_publish": ("weights_publish:3", {}),
    "weights_renamed": ("weights_renamed:3", {}),
    "shm_upload": ("shm_upload:3", MEMORY),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kill_at_each_window_recovers_the_same_training(
    case: str, seed_run: Path, reference: Outcome, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault, extra = CASES[case]
    monkeypatch.setenv(ENV, fault)
    got = train(seed_run, tmp_path, extra)
    record = fired(got.paths)
    assert (record["window"], record["step"], record["mode"]) == (case, int(fault[-1]), "kill")
    assert_same_training(got, reference)
    if "sync_method" not in extra.get("synchronizer", {}):
        assert latest_weights_version(got.paths) == STEPS


def test_a_hung_train_step_is_killed_within_the_bound_and_recovers(
    seed_run: Path,
    reference: Outcome,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(ENV, "train_forward:3:hang")
    with caplog.at_level(logging.WARNING, logger="trinity_dagster.trainer.engine_wrapper"):
        got = train(seed_run, tmp_path, {"service": {"progress_timeout_s": HANG_TIMEOUT_S}})
    record = fired(got.paths)
    assert record["mode"] == "hang"
    kills = [r for r in caplog.records if "killed the hung engine service" in r.getMessage()]
    assert len(kills) == 1, [r.getMessage() for r in caplog.records]
    detected_after = kills[0].created - record["fired_at"]
    assert HANG_TIMEOUT_S < detected_after < HANG_TIMEOUT_S + 2 * 2.0 + 5.0, detected_after
    assert_same_training(got, reference)


@pytest.fixture(scope="module")
def ppo_reference(seed_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The uninterrupted PPO run, once per module."""
    return train(seed_run, tmp_path_factory.mktemp("ppo_reference"), PPO)


def test_a_kill_during_the_critic_warmup_recovers_actor_and_critic(
    seed_run: Path, ppo_reference: Outcome, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Step 2 trains only the critic: a kill of engine rank 0 at its optimizer step (the
    critic's; the actor's does not step) ends with the same actor and critic."""
    monkeypatch.setenv(ENV, "optimizer_step:2")
    got = train(seed_run, tmp_path, PPO)
    assert fired(got.paths)["step"] == 2
    assert_same_training(got, ppo_reference)
    assert got.log.losses[2][0] is None and got.log.losses[3][0] is not None
    expected = ppo_reference.critic()
    critic = got.critic()
    assert critic.keys() == expected.keys()
    assert all(torch.equal(critic[k], expected[k]) for k in expected)
