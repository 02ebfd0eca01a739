"""Crash-safe file writes: a failed write changes nothing, the mode holds from the start,
and a flush left to the background happens, or its failure is raised."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import pytest

from trinity_dagster import files
from trinity_dagster.files import (
    PRIVATE_MODE,
    BackgroundFsync,
    write_file_atomic,
    write_text_atomic,
)
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import read_record, record_path, write_record


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


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, str]]:
    """Each fsync from now on, as (path, name of the thread that made it)."""
    made: list[tuple[Path, str]] = []
    real = files._fsync

    def recording(path: Path) -> None:
        real(path)
        made.append((Path(path), threading.current_thread().name))

    monkeypatch.setattr(files, "_fsync", recording)
    return made


def test_an_atomic_write_flushes_the_file_and_its_directory_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _record_fsyncs(monkeypatch)
    target = tmp_path / "record.json"
    write_text_atomic(target, "1")
    assert [path for path, _ in made][-1] == tmp_path and len(made) == 2
    made.clear()
    write_text_atomic(target, "2", fsync=False)
    assert made == [] and target.read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_step_record_is_flushed_by_the_background_thread_file_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _record_fsyncs(monkeypatch)
    paths = RunPaths.of(tmp_path)
    flush = BackgroundFsync("record-fsync")
    write_record(paths, {"step": 3, "metrics": {}}, flush)
    assert read_record(paths, 3) == {"step": 3, "metrics": {}}  # readable before the flush
    flush.wait()
    assert [path for path, _ in made] == [record_path(paths, 3), paths.step_records]
    assert {thread for _, thread in made} == {"record-fsync_0"}
    flush.close()


def test_a_failed_background_flush_is_raised_by_the_next_call(tmp_path: Path) -> None:
    flush = BackgroundFsync("test-fsync")
    flush.add(tmp_path / "gone.json")
    with pytest.raises(FileNotFoundError, match=r"gone\.json"):
        flush.wait()
    flush.add(tmp_path / "also-gone.json")
    while not flush._pending[0].done():
        time.sleep(0.01)
    with pytest.raises(FileNotFoundError, match=r"also-gone\.json"):
        flush.add(tmp_path)
    flush.close()
