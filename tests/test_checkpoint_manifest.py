"""manifest.json: what it lists, that it is written atomically, and every kind of corruption."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from trinity_dagster.checkpoint.manifest import (
    MANIFEST_FILE,
    CorruptCheckpointError,
    Manifest,
    build_manifest,
    read_manifest,
    sha256_file,
    verify_checkpoint,
    write_manifest,
)


def _make_checkpoint(root: Path, step: int = 7) -> Path:
    ckpt = root / f"global_step_{step}"
    (ckpt / "dist").mkdir(parents=True)
    (ckpt / "dist" / "shard_0.bin").write_bytes(os.urandom(3000))
    (ckpt / "huggingface").mkdir()
    (ckpt / "huggingface" / "config.json").write_text('{"a": 1}')
    (ckpt / "engine_state.json").write_text('{"step": 7}')
    manifest = build_manifest(
        ckpt, step=step, config_hash="abc123", sampler_state={"cursor": 42, "epoch": 1}
    )
    write_manifest(ckpt, manifest)
    return ckpt


def test_manifest_says_whether_the_checkpoint_served_as_the_sync(tmp_path: Path) -> None:
    ckpt = _make_checkpoint(tmp_path)
    assert read_manifest(ckpt).serves_as_sync is False
    served = build_manifest(
        ckpt, step=7, config_hash="abc123", sampler_state={}, serves_as_sync=True
    )
    write_manifest(ckpt, served)
    assert read_manifest(ckpt).serves_as_sync is True
    older = json.loads((ckpt / MANIFEST_FILE).read_text())
    del older["serves_as_sync"]  # written before the field existed: not a sync
    (ckpt / MANIFEST_FILE).write_text(json.dumps(older))
    assert read_manifest(ckpt).serves_as_sync is False
    (ckpt / MANIFEST_FILE).write_text(json.dumps({**older, "serves_as_sync": "yes"}))
    with pytest.raises(CorruptCheckpointError, match="serves_as_sync"):
        read_manifest(ckpt)


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    ckpt = _make_checkpoint(tmp_path)
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    listed = {item["path"]: item for item in data["files"]}
    on_disk = {
        p.relative_to(ckpt).as_posix(): p
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    }
    assert (
        set(listed)
        == set(on_disk)
        == {
            "dist/shard_0.bin",
            "huggingface/config.json",
            "engine_state.json",
        }
    )
    for rel, file in on_disk.items():
        assert listed[rel]["size"] == file.stat().st_size
        assert listed[rel]["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert data["step"] == 7 and data["complete"] is True
    assert data["config_hash"] == "abc123"
    assert data["sampler_state"] == {"cursor": 42, "epoch": 1}
    assert data["created_at"].endswith("+00:00")
    manifest = verify_checkpoint(ckpt)
    assert manifest.sampler_state == {"cursor": 42, "epoch": 1}
    assert manifest.digest() == hashlib.sha256(manifest.to_json().encode()).hexdigest()
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []


def test_sha256_file_streams_large_files(tmp_path: Path) -> None:
    blob = os.urandom((9 << 20) + 17)
    (tmp_path / "big").write_bytes(blob)
    assert sha256_file(tmp_path / "big") == hashlib.sha256(blob).hexdigest()


def _truncate(ckpt: Path) -> str:
    file = ckpt / "dist" / "shard_0.bin"
    file.write_bytes(file.read_bytes()[:-10])
    return r"shard_0\.bin: size 2990 bytes, the manifest says 3000"


def _flip_byte(ckpt: Path) -> str:
    file = ckpt / "dist" / "shard_0.bin"
    data = bytearray(file.read_bytes())
    data[1234] ^= 0x01
    file.write_bytes(bytes(data))
    return r"shard_0\.bin: sha256 .* does not match the manifest"


def _delete_file(ckpt: Path) -> str:
    (ckpt / "huggingface" / "config.json").unlink()
    return r"huggingface/config\.json: missing \(listed in the manifest\)"


def _delete_manifest(ckpt: Path) -> str:
    (ckpt / MANIFEST_FILE).unlink()
    return r"manifest\.json: no manifest \(the checkpoint is incomplete\)"


def _bad_json(ckpt: Path) -> str:
    text = (ckpt / MANIFEST_FILE).read_text()
    (ckpt / MANIFEST_FILE).write_text(text[: len(text) // 2])
    return r"manifest\.json: bad manifest JSON"


def _wrong_type(ckpt: Path) -> str:
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    data["files"][0]["size"] = "3000"
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"manifest\.json: bad manifest JSON: 'size' must be int, got str"


def _not_complete(ckpt: Path) -> str:
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    data["complete"] = False
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"manifest says the checkpoint is incomplete"


def _other_step(ckpt: Path) -> str:
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    data["step"] = 8
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"manifest is for step 8, the directory for step 7"


def _escaping_path(ckpt: Path) -> str:
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    data["files"][0]["path"] = "../outside.bin"
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"file path '\.\./outside\.bin' is not inside the checkpoint"


def _no_files(ckpt: Path) -> str:
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    data["files"] = []
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"manifest\.json: manifest lists no files"


def _directory_for_a_file(ckpt: Path) -> str:
    """A listed file replaced by a directory whose size the manifest was edited to match."""
    file = ckpt / "engine_state.json"
    file.unlink()
    file.mkdir()
    data = json.loads((ckpt / MANIFEST_FILE).read_text())
    for item in data["files"]:
        if item["path"] == "engine_state.json":
            item["size"] = file.stat().st_size
    (ckpt / MANIFEST_FILE).write_text(json.dumps(data))
    return r"engine_state\.json: not a regular file"


def _symlink_leaving(ckpt: Path) -> str:
    """A listed file replaced by a symlink to an identical file outside the checkpoint."""
    file = ckpt / "dist" / "shard_0.bin"
    outside = ckpt.parent / "elsewhere.bin"
    shutil.move(file, outside)
    file.symlink_to(outside)
    return r"shard_0\.bin: is or passes through a symlink to .*elsewhere\.bin \(outside the"


def _symlinked_directory_leaving(ckpt: Path) -> str:
    """A listed file's directory replaced by a symlink to an identical directory outside."""
    outside = ckpt.parent / "elsewhere"
    shutil.move(ckpt / "dist", outside)
    (ckpt / "dist").symlink_to(outside, target_is_directory=True)
    return r"dist/shard_0\.bin: is or passes through a symlink to .*elsewhere/shard_0\.bin \(out"


STRUCTURAL_FAULTS = [
    _no_files,
    _directory_for_a_file,
    _symlink_leaving,
    _symlinked_directory_leaving,
]


@pytest.mark.parametrize(
    "corrupt",
    [
        *STRUCTURAL_FAULTS,
        _truncate,
        _flip_byte,
        _delete_file,
        _delete_manifest,
        _bad_json,
        _wrong_type,
        _not_complete,
        _other_step,
        _escaping_path,
    ],
)
def test_every_corruption_is_an_error_naming_the_file(tmp_path: Path, corrupt) -> None:
    ckpt = _make_checkpoint(tmp_path)
    pattern = corrupt(ckpt)
    with pytest.raises(CorruptCheckpointError, match=pattern) as info:
        verify_checkpoint(ckpt)
    assert str(ckpt) in str(info.value)


@pytest.mark.parametrize("corrupt", STRUCTURAL_FAULTS)
def test_structural_faults_are_refused_without_checksums_too(tmp_path: Path, corrupt) -> None:
    ckpt = _make_checkpoint(tmp_path)
    pattern = corrupt(ckpt)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        verify_checkpoint(ckpt, checksums=False)


def test_without_checksums_a_flipped_byte_passes_but_a_truncation_does_not(
    tmp_path: Path,
) -> None:
    ckpt = _make_checkpoint(tmp_path)
    _flip_byte(ckpt)
    verify_checkpoint(ckpt, checksums=False)
    _truncate(ckpt)
    with pytest.raises(CorruptCheckpointError, match="size"):
        verify_checkpoint(ckpt, checksums=False)


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="global_step_3: checkpoint directory is"):
        read_manifest(tmp_path / "global_step_3")


def test_build_manifest_rejects_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "global_step_1"
    empty.mkdir()
    with pytest.raises(ValueError, match="no files to put in a manifest"):
        build_manifest(empty, step=1, config_hash="x", sampler_state={})
    (empty / "a.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="sampler_state of step 1 is not JSON-serializable"):
        build_manifest(empty, step=1, config_hash="x", sampler_state={"bad": object()})


def test_rewriting_a_manifest_is_atomic(tmp_path: Path, monkeypatch) -> None:
    ckpt = _make_checkpoint(tmp_path)
    before = (ckpt / MANIFEST_FILE).read_text()
    broken = Manifest.from_json(before, ckpt / MANIFEST_FILE)

    def failing_replace(src, dst):
        raise OSError("crash during rename (injected)")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        write_manifest(ckpt, broken)
    assert (ckpt / MANIFEST_FILE).read_text() == before
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "dist",
        "engine_state.json",
        "huggingface",
        MANIFEST_FILE,
    ]
