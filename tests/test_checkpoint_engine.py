"""CheckpointManager with the real Megatron TrainEngine (CPU, one rank): a background save that
serves as the sync while training goes on, then an exact resume in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine_workers.train_common import make_hf_dir
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    latest_weights_version,
    weights_dir,
)
from trinity_dagster.checkpoint.manager import latest_complete
from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint
from trinity_dagster.paths import RunPaths

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from pathlib import Path
import torch
from tests.engine_workers.train_common import make_batch, make_config
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.engine.engine import TrainEngine
from trinity_dagster.paths import RunPaths

def main():
    phase, hf_dir, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(root)
    engine = TrainEngine(config, hf_dir)
    manager = CheckpointManager(config, RunPaths.of(config.run_root), engine)
    try:
        result = {"resumed": manager.resume()}
        if phase == "first":
            for seed in (5, 6):
                engine.train_step(engine.step + 1, make_batch(seed))
            torch.save(engine.hf_state_dict(), out / "weights_2.pt")
            ticket = manager.save(2, sampler_state={"cursor": 16}, hf=True, serves_as_sync=True)
            engine.train_step(3, make_batch(7))  # training goes on during the background save
            result["pending_while_training"] = manager.pending_steps()
            manager.wait_all()
            result["finished"] = ticket.finished
        else:
            torch.save(engine.hf_state_dict(), out / "weights_resumed.pt")
            engine.train_step(3, make_batch(7))
            manager.save(3, block=True)
        torch.save(engine.hf_state_dict(), out / "weights_3.pt")
        (out / "result.json").write_text(json.dumps(result))
    finally:
        manager.wait_all()
        engine.close()


if __name__ == "__main__":  # dist_checkpointing's writer uses multiprocessing
    main()
"""


def _run(tmp: Path, phase: str, hf_dir: Path) -> tuple[Path, dict]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    out = tmp / phase
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), phase, str(hf_dir), str(tmp), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, json.loads((out / "result.json").read_text())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_engine_checkpoint_serves_as_sync_and_resumes_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir = make_hf_dir(tmp_path / "hf")
    first, result = _run(tmp_path, "first", hf_dir)
    assert result == {"resumed": None, "pending_while_training": [2], "finished": True}
    paths = RunPaths.of(tmp_path / "run")
    ckpt = checkpoint_dir(paths, 2)
    manifest = verify_checkpoint(ckpt)
    assert manifest.sampler_state == {"cursor": 16}
    listed = {f.path for f in manifest.files}
    assert "engine_state.json" in listed and "huggingface/config.json" in listed
    assert any(p.startswith("dist/") for p in listed)
    assert latest_checkpoint_step(paths) == 2 and latest_weights_version(paths) == 2
    assert weights_dir(paths, 2) == ckpt / "huggingface"
    exported = AutoModelForCausalLM.from_pretrained(weights_dir(paths, 2)).state_dict()
    at_save = torch.load(first / "weights_2.pt")
    assert all(torch.equal(exported[k], at_save[k]) for k in at_save)

    second, result = _run(tmp_path, "resume", hf_dir)
    assert result == {"resumed": 2}
    assert _same(torch.load(second / "weights_resumed.pt"), at_save)
    assert _same(torch.load(second / "weights_3.pt"), torch.load(first / "weights_3.pt"))
    assert latest_checkpoint_step(paths) == 3

    shard = next(p for p in sorted((checkpoint_dir(paths, 3) / "dist").rglob("*")) if p.is_file())
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match=str(shard.name)):
        verify_checkpoint(checkpoint_dir(paths, 3))
    assert latest_complete(paths) == (2, ckpt)
