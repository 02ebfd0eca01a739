"""The checkpoint tests' `TinyProvider` round-trips its state exactly, also when saved in
the background."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.support.checkpoint import TinyProvider


def test_save_and_load_round_trip_continues_identically(tmp_path: Path) -> None:
    original = TinyProvider(seed=1)
    for _ in range(3):
        original.train()
    original.save_state(tmp_path / "ckpt").wait()
    expected = [original.train() for _ in range(3)]

    restored = TinyProvider(seed=99)
    restored.load_state(tmp_path / "ckpt")
    assert restored.step == 3
    assert [restored.train() for _ in range(3)] == expected
    for name, value in original.params().items():
        assert torch.equal(restored.params()[name], value)


def test_background_save_writes_the_snapshot_taken_at_save_time(tmp_path: Path) -> None:
    provider = TinyProvider()
    provider.train()
    at_save = provider.params()
    provider.gate = threading.Event()
    handle = provider.save_state(tmp_path / "ckpt", background=True)
    provider.train()
    assert not handle.done()
    provider.gate.set()
    handle.wait()
    saved = torch.load(tmp_path / "ckpt" / "model.pt")
    assert all(torch.equal(saved[k], v) for k, v in at_save.items())
    assert not torch.equal(saved["1.weight"], provider.params()["1.weight"])
