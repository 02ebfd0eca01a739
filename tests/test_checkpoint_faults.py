"""Crash safety under `kill -9`: a process saves checkpoints in a loop (background and blocking,
with and without HF exports, with retention) and is killed at random moments, then restarted.

After every kill, every `global_step_N/` verifies with checksums, the marker names one of them,
and the newest complete checkpoint never goes backwards across restarts.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.checkpoint import TinyProvider, damage_checksum_only
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    scan_step_dirs,
)
from trinity_dagster.checkpoint.manager import CheckpointManager, latest_complete
from trinity_dagster.checkpoint.manifest import (
    MANIFEST_FILE,
    CorruptCheckpointError,
    verify_checkpoint,
)
from trinity_dagster.config import config_from_dict
from trinity_dagster.paths import RunPaths

REPO = Path(__file__).resolve().parents[1]

SAVER = """
import random, sys, time
from pathlib import Path
from tests.support.checkpoint import TinyProvider
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.config import config_from_dict
from trinity_dagster.paths import RunPaths

root, seed = Path(sys.argv[1]), int(sys.argv[2])
random.seed(seed)
config = config_from_dict({"run_root": str(root), "trainer": {"max_checkpoints_to_keep": 2}})
provider = TinyProvider(seed=seed)
provider.file_delay = 0.03
manager = CheckpointManager(config, RunPaths.of(root), provider)
print("ready", manager.resume(), flush=True)
while True:
    provider.train()
    manager.save(
        provider.step,
        sampler_state={"cursor": provider.step * 4},
        hf=random.random() < 0.5,
        block=random.random() < 0.3,
    )
    if len(manager.pending_steps()) > 2:
        manager.wait_all()
    manager.poll()
    time.sleep(random.random() * 0.02)
"""


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_bad_checkpoint_visible(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    newest_seen = 0
    kills = 0
    for round_ in range(12):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(paths.root), str(round_)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = proc.stdout.readline().split()
        assert ready[:1] == ["ready"], proc.stderr.read()
        resumed = None if ready[1] == "None" else int(ready[1])
        assert (resumed or 0) == newest_seen, f"round {round_} resumed from {resumed}"
        time.sleep(rng.uniform(0.05, 0.8))
        assert proc.poll() is None, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        kills += 1

        finals = [d for d in scan_step_dirs(paths.checkpoints) if d.kind == "final"]
        for entry in finals:
            verify_checkpoint(entry.path)  # raises naming the file if anything is off
        marker = latest_checkpoint_step(paths)
        if marker is not None:
            assert verify_checkpoint(checkpoint_dir(paths, marker)).step == marker
        found = latest_complete(paths)
        step = 0 if found is None else found[0]
        assert step >= newest_seen and (marker is None or step >= marker)
        newest_seen = step
    assert kills >= 10
    assert newest_seen > 0, "no checkpoint was ever completed"


def test_when_every_checkpoint_is_damaged_the_error_lists_each_and_why(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    config = config_from_dict({"run_root": str(tmp_path)})
    provider = TinyProvider()
    saver = CheckpointManager(config, paths, provider)
    for step in (1, 2):
        provider.train()
        saver.save(step, block=True)
    damage_checksum_only(checkpoint_dir(paths, 1))
    (checkpoint_dir(paths, 2) / MANIFEST_FILE).unlink()

    restarted = CheckpointManager(config, paths, TinyProvider(seed=1))
    with pytest.raises(CorruptCheckpointError) as info:
        restarted.resume()
    message = str(info.value)
    assert message.startswith(f"no complete checkpoint under {paths.checkpoints}; tried 2: ")
    assert "global_step_2 (" in message and "manifest.json: no manifest" in message
    assert "global_step_1 (" in message and "model.pt: sha256" in message


def test_with_no_checkpoint_at_all_load_says_there_is_none(tmp_path: Path) -> None:
    config = config_from_dict({"run_root": str(tmp_path)})
    manager = CheckpointManager(config, RunPaths.of(tmp_path), TinyProvider())
    assert manager.resume() is None
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint under .*: no global_step"):
        manager.load()
