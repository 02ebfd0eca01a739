"""Fixtures shared by several test modules."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module: on 2 shared cores, more threads thrash
    (measured 30x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def stop_signals_act() -> None:
    """The processes the tests start stop on SIGTERM even where the shell that started pytest
    ignored it (each ignored signal is inherited and would hold a teardown for its timeout)."""
    from trinity_dagster.commands.daemon_control import restore_stop_signals

    restore_stop_signals()


@pytest.fixture
def no_initial_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic experiences need only a vocabulary size, not the tiny torch model."""
    import trinity_dagster.testing as testing

    monkeypatch.setattr(testing, "vocab_size", lambda config: 96)


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh directory with a short path, for tests whose wake-up sockets must bind: a Unix
    socket's path holds at most 107 bytes, which pytest's `tmp_path` (deeper under a worker's
    folder with `-n`) can exceed, and a waiter that cannot bind polls instead."""
    with tempfile.TemporaryDirectory(prefix="td-") as directory:
        yield Path(directory)
