"""CheckpointManager with the real Megatron TrainEngine (CPU, one rank): a background save that
serves as the sync while training goes on, then an exact resume in a fresh process. And the
engine's state writers (thread and fork, one and two ranks): the background save is a snapshot
of the step it was started at, and sharding validation runs only for a new structure."""

from __future__ import annotations

import json
import os
import queue
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
from trinity_dagster.testing import free_port

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from pathlib import Path
import torch
from tests.engine_workers.train_common import make_batch, engine_config
from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.engine.engine import TrainEngine
from trinity_dagster.paths import RunPaths

def main():
    phase, hf_dir, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    config = engine_config(root)
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


WRITER_WORKER = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from tests.engine_workers.train_common import make_batch, engine_config
from trinity_dagster.engine import async_save
from trinity_dagster.engine.engine import TrainEngine

def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

def main():
    writer, hf_dir, root, tp = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    validated = []
    save = async_save.dist_checkpointing.save
    def spy(*args, **kwargs):
        validated.append(kwargs["validate_access_integrity"])
        return save(*args, **kwargs)
    async_save.dist_checkpointing.save = spy
    engine = TrainEngine(engine_config(root, **{"megatron.tensor_model_parallel_size": tp}), hf_dir)
    engine._async_saves.close()
    engine._async_saves = async_save.SaveQueue(writer)
    try:
        for seed in (5, 6):
            engine.train_step(engine.step + 1, make_batch(seed))
        at_2 = engine.hf_state_dict()
        handle = engine.save_state(root / "s2", background=True)  # planned from scratch
        engine.train_step(3, make_batch(7))  # weights change while the writer runs
        after_3 = engine.hf_state_dict()
        handle.wait()
        engine.save_state(root / "s3").wait()  # reuses the local plan
        engine.train_step(4, make_batch(8))
        at_4 = engine.hf_state_dict()
        handle = engine.save_state(root / "s4", background=True)  # reuses the global plan
        engine.train_step(5, make_batch(9))
        after_5 = engine.hf_state_dict()
        handle.wait()
        checks = {}
        for name, saved, step, batch, trained in [
            ("s4", at_4, 5, 9, after_5),
            ("s3", after_3, 4, 8, at_4),
            ("s2", at_2, 3, 7, after_3),
        ]:
            engine.load_state(root / name)
            restored = engine.hf_state_dict()  # collective
            engine.train_step(step, make_batch(batch))
            resumed = engine.hf_state_dict()
            checks[name] = [same(restored, saved), same(resumed, trained)]
        if dist.get_rank() == 0:
            result = {
                "validated": validated,
                "changed_during_saves": [not same(after_3, at_2), not same(after_5, at_4)],
                "restored_and_resumed": checks,
            }
            (root / "result.json").write_text(json.dumps(result))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("writer", "ranks"), [("thread", 1), ("fork", 1), ("thread", 2)])
def test_state_writers_save_a_snapshot_and_validate_a_new_structure_once(
    tmp_path: Path, writer: str, ranks: int
) -> None:
    hf_dir = make_hf_dir(tmp_path / "hf")
    script = tmp_path / "writer_worker.py"
    script.write_text(WRITER_WORKER)
    args = [str(script), writer, str(hf_dir), str(tmp_path), str(ranks)]
    launch = [sys.executable]
    if ranks > 1:  # tensor parallel over 2 ranks
        launch += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
        launch += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "validated": [True, False, False],
        "changed_during_saves": [True, True],
        "restored_and_resumed": {name: [True, True] for name in ("s4", "s3", "s2")},
    }


def test_save_queue_rejects_an_unknown_writer() -> None:
    from trinity_dagster.engine.async_save import SaveQueue

    with pytest.raises(ValueError, match="writer must be 'fork' or 'thread', got 'disk'"):
        SaveQueue("disk")


def test_thread_writer_reports_a_failed_write(tmp_path: Path) -> None:
    from trinity_dagster.engine.async_save import _write_buckets

    results: queue.Queue = queue.Queue()
    missing = tmp_path / "no_such_dir" / "__0_0.distcp"
    _write_buckets([], [(str(missing), "__0_0.distcp", ([], []))], results)
    error = results.get_nowait()
    assert isinstance(error, FileNotFoundError) and str(missing) in str(error)


def test_structure_tracks_shards_not_values() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from trinity_dagster.engine.async_save import _structure

    def state(rows: int, key: str = "w", step: int = 1) -> dict:
        tensor = torch.full((rows, 3), float(step))
        return {"model": {key: ShardedTensor.from_rank_offsets(key, tensor)}, "step": step}

    assert _structure(state(2, step=1)) == _structure(state(2, step=9))
    assert _structure(state(2)) != _structure(state(4))
    assert _structure(state(2)) != _structure(state(2, key="v"))
    replica = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=1)
    assert _structure(state(2)) != _structure({"model": {"w": replica}, "step": 1})


def test_write_results_queue_is_in_process_unless_a_writer_process_needs_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from trinity_dagster.engine.async_save import ensure_write_results_queue

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    ensure_write_results_queue(cross_process=False)
    local = filesystem_async._get_write_results_queue()  # what Megatron's writers use
    assert isinstance(local, queue.Queue)
    ensure_write_results_queue(cross_process=False)
    assert filesystem_async._results_queue is local
    local.put({"unread": "results"})
    with pytest.raises(RuntimeError, match="results of a save are still unread"):
        ensure_write_results_queue(cross_process=True)
    local.get_nowait()
    ensure_write_results_queue(cross_process=True)
    shared = filesystem_async._get_write_results_queue()
    assert not isinstance(shared, queue.Queue)
    child = os.fork()  # a forked writer's results reach this process
    if child == 0:
        shared.put({0: ["written"]})
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert shared.get(timeout=10) == {0: ["written"]}
    ensure_write_results_queue(cross_process=False)  # a cross-process queue serves both
    assert filesystem_async._results_queue is shared
