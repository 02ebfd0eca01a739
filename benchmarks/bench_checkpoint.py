"""Benchmark of checkpoints: what the manifest, the crash-safe finalization and background saves
cost against plain writes of the same state.

Baselines measured in the same run: `torch.save` of the state (what a save without a manifest
costs), a plain read of the files (what `verify_checkpoint` costs without hashing), and a plain
`safetensors` `save_file` (what `publish_weights` costs without temp dir, fsync and rename).
Figures: seconds and ratios; `background_block_ms` is how long a background save holds the
caller (snapshot + hand-off) against a blocking save's full time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from trinity_dagster.checkpoint.manager import CheckpointManager
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.checkpoint.publish import publish_weights
from trinity_dagster.config import config_from_dict
from trinity_dagster.paths import RunPaths


class _Handle:
    def __init__(self, thread: threading.Thread | None) -> None:
        self._thread = thread

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class _Provider:
    """Weights plus two Adam moments: `mib` MiB of float32 tensors in total."""

    def __init__(self, mib: int) -> None:
        per_tensor = 1 << 18  # 1 MiB of float32
        count = max(1, mib // 3)
        self.weights = {f"layer{i}.weight": torch.randn(per_tensor) for i in range(count)}
        self.moments = {
            name: (torch.zeros_like(t), torch.zeros_like(t)) for name, t in self.weights.items()
        }
        self.step = 1

    def _write(self, ckpt_dir: Path, snapshot: dict) -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.save(snapshot["weights"], ckpt_dir / "model.pt")
        torch.save(snapshot["moments"], ckpt_dir / "optim.pt")

    def save_state(self, ckpt_dir: Path, *, background: bool = False) -> _Handle:
        snapshot = {
            "weights": {k: v.clone() for k, v in self.weights.items()},
            "moments": {k: (a.clone(), b.clone()) for k, (a, b) in self.moments.items()},
        }
        if not background:
            self._write(ckpt_dir, snapshot)
            return _Handle(None)
        thread = threading.Thread(target=self._write, args=(ckpt_dir, snapshot))
        thread.start()
        return _Handle(thread)

    def load_state(self, ckpt_dir: Path) -> None:
        self.weights = torch.load(ckpt_dir / "model.pt")

    def export_hf(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        save_file(self.weights, str(out_dir / "model.safetensors"))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=96, help="size of the saved state in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = config_from_dict(
            {"run_root": str(root / "run"), "trainer": {"max_checkpoints_to_keep": 2}}
        )
        paths = RunPaths.of(config.run_root)
        provider = _Provider(args.mib)
        manager = CheckpointManager(config, paths, provider)
        state_bytes = sum(t.numel() * 4 for t in provider.weights.values()) * 3
        counter = iter(range(10_000))

        def raw_save() -> None:
            provider.save_state(root / f"raw_{next(counter)}").wait()

        def managed_save(block: bool) -> float:
            provider.step += 1
            start = time.perf_counter()
            manager.save(provider.step, block=block)
            held = time.perf_counter() - start
            manager.wait_all()
            return held

        raw_s = _median_s(raw_save, args.repeats)
        blocking_s = statistics.median(managed_save(True) for _ in range(args.repeats))
        background_held_s = statistics.median(managed_save(False) for _ in range(args.repeats))

        ckpt = paths.checkpoints / f"global_step_{provider.step}"
        files = [p for p in ckpt.rglob("*") if p.is_file()]
        read_s = _median_s(lambda: [p.read_bytes() for p in files], args.repeats)
        verify_s = _median_s(lambda: verify_checkpoint(ckpt), args.repeats)
        size_checks_s = _median_s(lambda: verify_checkpoint(ckpt, checksums=False), args.repeats)

        raw_st_s = _median_s(
            lambda: save_file(provider.weights, str(root / "plain.safetensors")), args.repeats
        )
        version = iter(range(10_000))
        publish_s = _median_s(
            lambda: publish_weights(paths, next(version), provider.weights, {}, None), args.repeats
        )
    mib = state_bytes / (1 << 20)
    figures = {
        "state_mib": round(mib, 1),
        "raw_torch_save_s": round(raw_s, 3),
        "managed_blocking_save_s": round(blocking_s, 3),
        "ratio_managed_raw": round(blocking_s / raw_s, 3),
        "background_block_ms": round(background_held_s * 1000, 1),
        "blocked_vs_blocking_ratio": round(background_held_s / blocking_s, 3),
        "raw_read_mib_per_s": round(mib / read_s, 1),
        "verify_sha256_mib_per_s": round(mib / verify_s, 1),
        "verify_sizes_only_ms": round(size_checks_s * 1000, 2),
        "raw_safetensors_save_s": round(raw_st_s, 3),
        "publish_weights_s": round(publish_s, 3),
        "publish_vs_safetensors_ratio": round(publish_s / raw_st_s, 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
