"""Shared pieces of the checkpoint tests (no tests here): a small real state provider
(torch module + AdamW, torch.save files, background saves on a thread) and a way to damage
a checkpoint that only its checksums notice."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

STATE_FILES = ("model.pt", "optim.pt", "rng.pt", "state.json")


class ThreadSaveHandle:
    """A save running on a thread; `wait()` re-raises its error."""

    def __init__(self, target) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                target()
            except BaseException as err:
                self._error = err

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


class TinyProvider:
    """A tiny language-model-like module trained with AdamW; saves like an engine would."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step = 0
        self.gate: threading.Event | None = None
        self.fail_with: BaseException | None = None
        self.file_delay = 0.0

    def train(self) -> float:
        tokens = torch.randint(0, 16, (4,))
        logits = self.model(tokens)
        loss = nn.functional.cross_entropy(logits, torch.roll(tokens, 1))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_state(self, ckpt_dir: Path, *, background: bool = False) -> ThreadSaveHandle:
        snapshot = {
            "model": self.params(),
            "optim": copy.deepcopy(self.optimizer.state_dict()),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }
        gate, fail, delay = self.gate, self.fail_with, self.file_delay

        def write() -> None:
            if gate is not None:
                gate.wait()
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            for name in ("model", "optim", "rng"):
                torch.save(snapshot[name], ckpt_dir / f"{name}.pt")
                time.sleep(delay * random.random())
                if fail is not None:
                    raise fail
            (ckpt_dir / "state.json").write_text(json.dumps({"step": snapshot["step"]}))

        if background:
            return ThreadSaveHandle(write)
        write()
        return ThreadSaveHandle(lambda: None)

    def load_state(self, ckpt_dir: Path) -> None:
        self.model.load_state_dict(torch.load(ckpt_dir / "model.pt"))
        self.optimizer.load_state_dict(torch.load(ckpt_dir / "optim.pt"))
        torch.set_rng_state(torch.load(ckpt_dir / "rng.pt"))
        self.step = json.loads((ckpt_dir / "state.json").read_text())["step"]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.params()

    def export_hf(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "tiny", "step": self.step}))
        save_file(self.hf_state_dict(), str(out_dir / "model.safetensors"))


def damage_checksum_only(ckpt: Path) -> None:
    """Damage a checkpoint so that only its checksums notice (size and manifest intact)."""
    file = ckpt / "model.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
