"""Crash-safe file writes: a failed write changes nothing, the mode holds from the start."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from trinity_dagster.files import PRIVATE_MODE, write_file_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    write_text_atomic(target, "old")

    def crash(tmp: Path) -> None:
        tmp.write_text("half of the new")
        raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        write_file_atomic(target, crash)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_private_file_is_never_readable_by_others(tmp_path: Path) -> None:
    target = tmp_path / "service" / "token"
    modes: list[int] = []

    def write_secret(tmp: Path) -> None:
        modes.append(stat.S_IMODE(tmp.stat().st_mode))
        tmp.write_text("secret")

    write_file_atomic(target, write_secret, mode=PRIVATE_MODE)
    assert modes == [0o600]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "secret"
    write_text_atomic(tmp_path / "marker.txt", "3\n")
    assert stat.S_IMODE((tmp_path / "marker.txt").stat().st_mode) == 0o644
