"""Checkpoint costs seen by the train loop of the real Megatron `TrainEngine` (CPU, one rank).

A tiny random HF Llama (hidden 256, 4 layers, vocab 8192 by default: ~100 MiB of weights
and Adam state) is trained by a `TrainEngine`; a `CheckpointManager` saves it.

- blocking save: wall time of `manager.save(step, block=True)` (state written, hashed,
  fsynced, manifest, rename) — the baseline.
- background save, as the train loop sees it: the save is started after a step, training goes
  on and `poll()` runs after every step until the save is finalized. The loop's extra time is
  the whole loop's wall time minus the same number of clean steps (the median of the 3 steps
  right before the save and the 3 right after it, so that the machine's drift over the run
  does not count): it includes `save()` returning, the steps slowed down while the writer runs
  (CPU and GIL shared with it, copy-on-write faults) and the finalizing `poll()`. Parts are
  reported too.
- the first background save of the process is reported on its own (one-time set-up).
- publishing synced weights (`publish_weights` of the engine's `hf_state_dict()`) against a
  plain `safetensors.torch.save_file` of the same tensors.
- the same background save with Megatron's forked writer process (`fork_writer_*`), the
  engine's writer before it wrote from a snapshot on a thread (see `engine/async_save.py`).

Each figure is the median of `--repeats`; the last line printed is one JSON object. Torch runs
with `--threads` intra-op threads (1: on a small shared machine more threads make every step,
and the figures, much noisier).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.synthetic import grpo_batch, make_llama_dir

CLEAN_STEPS_AROUND = 3  # clean steps before and after each background save, its baseline


def timed(fn) -> float:
    """Wall seconds of `fn()`."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Loop:
    """The engine, its checkpoint manager and a train loop that polls after every step."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        from trinity_dagster.checkpoint.manager import CheckpointManager
        from trinity_dagster.config import config_from_dict
        from trinity_dagster.engine.engine import TrainEngine
        from trinity_dagster.paths import RunPaths

        make_llama_dir(
            root / "hf",
            vocab=args.vocab,
            hidden=args.hidden,
            ffn=4 * args.hidden,
            layers=args.layers,
            heads=4,
            seq=args.seq,
        )
        config = config_from_dict(
            {
                "run_root": str(root / "run"),
                "model": {
                    "max_prompt_tokens": args.seq // 2,
                    "max_response_tokens": args.seq // 2,
                    "max_position_embeddings": 2 * args.seq,
                },
                "algorithm": {"repeat_times": 4},
                "buffer": {"train_batch_size": 4},
                "trainer": {
                    "micro_batch_size": 4,
                    "total_steps": 10_000,
                    "max_checkpoints_to_keep": 2,
                    "optim": {"lr": 1e-5},
                },
            }
        )
        self.paths = RunPaths.of_config(config)
        self.engine = TrainEngine(config, root / "hf")
        self.manager = CheckpointManager(config, self.paths, self.engine)
        self.args = args
        self._gen = torch.Generator().manual_seed(0)
        self.clean_steps: list[float] = []
        self.poll_s = 0.0

    def step(self) -> float:
        """Train the next step and poll the manager; wall seconds (poll time adds to poll_s)."""
        batch = grpo_batch(self._gen, rows=4, seq=self.args.seq, vocab=self.args.vocab)
        started = time.perf_counter()
        self.engine.train_step(self.engine.step + 1, batch)
        polled = time.perf_counter()
        self.manager.poll()
        self.poll_s += time.perf_counter() - polled
        return time.perf_counter() - started

    def clean_step(self) -> float:
        """A step with no save in flight, for the baseline step time; its wall seconds."""
        assert not self.manager.pending_steps()
        took = self.step()
        self.clean_steps.append(took)
        return took

    def background_save(self, *, hf: bool, writer: str | None = None) -> dict[str, float]:
        """Save in the background and train until it is finalized; the loop's costs.

        `writer` picks the engine's state writer for this save ("thread", "fork"; None: the
        engine's default).
        """
        from trinity_dagster.engine.async_save import SaveQueue

        default = self.engine._async_saves
        if writer is not None:
            self.engine._async_saves = SaveQueue(writer)
        around = [self.clean_step() for _ in range(CLEAN_STEPS_AROUND)]
        step = self.engine.step
        held = timed(lambda: self.manager.save(step, hf=hf, block=False))
        self.poll_s = 0.0
        loop_s, steps, first_step = held, 0, None
        while self.manager.is_pending(step):
            if steps >= self.args.max_steps_per_save:
                loop_s += timed(lambda: self.manager.wait(step))
                break
            took = self.step()
            first_step = took if first_step is None else first_step
            loop_s += took
            steps += 1
        poll_s = self.poll_s
        if writer is not None:
            self.engine._async_saves.close()
            self.engine._async_saves = default
        around += [self.clean_step() for _ in range(CLEAN_STEPS_AROUND)]
        clean = statistics.median(around)
        return {
            "held_s": held,
            "poll_s": poll_s,
            "blocked_s": loop_s - steps * clean,
            "first_step_extra_s": (first_step or clean) - clean,
            "steps_while_saving": steps,
        }

    def blocking_save(self, *, hf: bool) -> float:
        """Wall seconds of a blocking save of the next step."""
        self.step()
        step = self.engine.step
        took = timed(lambda: self.manager.save(step, hf=hf, block=True))
        self.clean_step()
        return took


def median_of(runs: list[dict[str, float]], key: str) -> float:
    """The median of one figure over repeated runs."""
    return statistics.median(run[key] for run in runs)


def publish_figures(loop: Loop, root: Path, repeats: int) -> dict[str, float]:
    """publish_weights of the engine's HF tensors vs a plain safetensors save_file."""
    from safetensors.torch import save_file

    from trinity_dagster.checkpoint.publish import publish_weights

    tensors = loop.engine.hf_state_dict()
    hf_dir = root / "hf"
    plain, publish = [], []
    for version in range(1, repeats + 1):
        plain.append(timed(lambda: save_file(tensors, str(root / "plain.safetensors"))))
        publish.append(
            timed(
                lambda v=version: publish_weights(
                    loop.paths, v, tensors, loop.engine.hf_config, hf_dir
                )
            )
        )
    plain_s, publish_s = statistics.median(plain), statistics.median(publish)
    return {
        "raw_safetensors_save_s": round(plain_s, 3),
        "publish_weights_s": round(publish_s, 3),
        "publish_vs_safetensors_ratio": round(publish_s / plain_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-steps-per-save", type=int, default=40)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (as the tests use)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loop = Loop(root, args)
        try:
            for _ in range(3):
                loop.clean_step()
            first = loop.background_save(hf=False)
            blocking, background, forked = [], [], []
            for _ in range(args.repeats):  # interleaved, so each kind sees the same load
                blocking.append(loop.blocking_save(hf=False))
                background.append(loop.background_save(hf=False))
                forked.append(loop.background_save(hf=False, writer="fork"))
            blocking_hf = [loop.blocking_save(hf=True) for _ in range(args.repeats)]
            background_hf = [loop.background_save(hf=True) for _ in range(args.repeats)]
            figures: dict[str, Any] = {"state_mib": round(state_mib(loop.paths), 1)}
            figures.update(publish_figures(loop, root, args.repeats))
        finally:
            loop.manager.wait_all()
            loop.engine.close()
    blocking_s, blocked_s = statistics.median(blocking), median_of(background, "blocked_s")
    blocking_hf_s = statistics.median(blocking_hf)
    figures.update(
        {
            "train_step_s": round(statistics.median(loop.clean_steps), 3),
            "first_background_held_s": round(first["held_s"], 3),
            "first_background_blocked_s": round(first["blocked_s"], 3),
            "blocking_save_s": round(blocking_s, 3),
            "background_held_s": round(median_of(background, "held_s"), 3),
            "background_poll_s": round(median_of(background, "poll_s"), 3),
            "background_first_step_extra_s": round(median_of(background, "first_step_extra_s"), 3),
            "background_steps_while_saving": median_of(background, "steps_while_saving"),
            "background_blocked_s": round(blocked_s, 3),
            "blocked_vs_blocking_ratio": round(blocked_s / blocking_s, 3),
            "held_vs_blocking_ratio": round(median_of(background, "held_s") / blocking_s, 3),
            "fork_writer_held_s": round(median_of(forked, "held_s"), 3),
            "fork_writer_first_step_extra_s": round(median_of(forked, "first_step_extra_s"), 3),
            "fork_writer_blocked_s": round(median_of(forked, "blocked_s"), 3),
            "hf_blocking_save_s": round(blocking_hf_s, 3),
            "hf_background_held_s": round(median_of(background_hf, "held_s"), 3),
            "hf_background_blocked_s": round(median_of(background_hf, "blocked_s"), 3),
            "hf_blocked_vs_blocking_ratio": round(
                median_of(background_hf, "blocked_s") / blocking_hf_s, 3
            ),
        }
    )
    print(json.dumps(figures))


def state_mib(paths) -> float:
    """Size of the newest complete checkpoint on disk, MiB."""
    from trinity_dagster.checkpoint.manager import latest_complete

    found = latest_complete(paths, checksums=False)
    assert found is not None, "no complete checkpoint was written"
    return sum(p.stat().st_size for p in found[1].rglob("*") if p.is_file()) / (1 << 20)


if __name__ == "__main__":  # dist_checkpointing's writer uses multiprocessing
    main()
