"""Weights versions in shared memory (`synchronizer.sync_method: memory`), for local explorers.

    /dev/shm/trinity-dagster-<hash of the run root>/
        global_step_N.weights              one version: header, then every tensor's bytes
        latest_state_dict_iteration.txt    the newest complete version

A region file is 8 bytes (little-endian header length), a JSON header (`version`, and per HF
tensor name its `dtype`, `shape`, `offset` and `nbytes`), then the tensors, each starting at a
multiple of `ALIGN` bytes. It appears only by an atomic rename of a finished temp file, and the
marker moves (never backwards) only after that, so a reader sees whole versions. The newest
`KEEP` versions are kept. torch is imported only when writing or reading tensors.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trinity_dagster.checkpoint.layout import (
    LATEST_WEIGHTS_FILE,
    latest_weights_version,
    read_marker,
    step_dir_name,
)
from trinity_dagster.faults import fault_point
from trinity_dagster.files import write_file_atomic, write_text_atomic
from trinity_dagster.paths import SHM_ROOT, RunPaths

if TYPE_CHECKING:
    from torch import Tensor

ALIGN = 64
KEEP = 2
SUFFIX = ".weights"
_HEADER_LENGTH = struct.Struct("<Q")
_REGION_NAME = re.compile(r"global_step_(\d+)\.weights")


class ShmWeightsError(ValueError):
    """A shared-memory region does not hold the version it is named after, whole."""


def shm_dir(paths: RunPaths) -> Path:
    """The shared-memory directory of the run root `paths.root` (unique per resolved path)."""
    digest = hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:16]
    return SHM_ROOT / f"trinity-dagster-{digest}"


def region_path(paths: RunPaths, version: int) -> Path:
    """The region file of weights `version`."""
    return shm_dir(paths) / f"{step_dir_name(version)}{SUFFIX}"


def latest_shm_version(paths: RunPaths) -> int | None:
    """The newest complete version in shared memory, or None if there is none."""
    return read_marker(shm_dir(paths) / LATEST_WEIGHTS_FILE)


def newest_weights_version(paths: RunPaths, *, memory: bool) -> int | None:
    """The newest weights version explorers can load: published, or in shared memory if `memory`."""
    found = [latest_weights_version(paths), latest_shm_version(paths) if memory else None]
    versions = [v for v in found if v is not None]
    return max(versions) if versions else None


def shm_versions(paths: RunPaths) -> list[int]:
    """Every version with a complete region file, oldest first."""
    directory = shm_dir(paths)
    if not directory.is_dir():
        return []
    found = (_REGION_NAME.fullmatch(entry.name) for entry in directory.iterdir())
    return sorted(int(match.group(1)) for match in found if match)


def write_shm_weights(paths: RunPaths, version: int, tensors: Mapping[str, Tensor]) -> Path:
    """Write weights `version` as a region, move the marker to it, drop all but the newest `KEEP`.

    Returns the region file.
    """
    if version < 0:
        raise ValueError(f"weights version must be >= 0, got {version}")
    header, size = _header(version, tensors)
    target = region_path(paths, version)
    write_file_atomic(target, lambda tmp: _write_and_check(tmp, header, tensors, size))
    current = latest_shm_version(paths)
    if current is None or version > current:
        write_text_atomic(shm_dir(paths) / LATEST_WEIGHTS_FILE, f"{version}\n")
    prune_shm(paths)
    return target


def read_shm_weights(paths: RunPaths, version: int) -> dict[str, Tensor]:
    """The tensors of weights `version` by HF name (views of a private copy-on-write mapping).

    Once mapped, the tensors stay valid even if the region is pruned meanwhile.
    """
    import torch

    path = region_path(paths, version)
    try:
        with path.open("rb") as source:
            mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no weights version {version} in shared memory at {path}; held: "
            f"{shm_versions(paths) or 'none'}"
        ) from None
    header, data_start = _read_header(path, mapped, version)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors: dict[str, Tensor] = {}
    for name, entry in header["tensors"].items():
        start = data_start + entry["offset"]
        raw = flat[start : start + entry["nbytes"]]
        tensors[name] = raw.view(getattr(torch, entry["dtype"])).view(entry["shape"])
    return tensors


def prune_shm(paths: RunPaths) -> list[Path]:
    """Delete regions older than the newest `KEEP` up to the marker; return what was deleted."""
    current = latest_shm_version(paths)
    if current is None:
        return []
    kept = [v for v in shm_versions(paths) if v <= current][-KEEP:]
    deleted = []
    for version in shm_versions(paths):
        if version < current and version not in kept:
            path = region_path(paths, version)
            path.unlink(missing_ok=True)  # a reader that mapped it keeps its pages
            deleted.append(path)
    return deleted


def remove_shm_dir(paths: RunPaths) -> None:
    """Delete the run root's shared-memory directory (when the engine service stops)."""
    shutil.rmtree(shm_dir(paths), ignore_errors=True)


def _header(version: int, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Any], int]:
    """The region header of `tensors` and the size of its data part in bytes."""
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "offset": offset,
            "nbytes": nbytes,
        }
        offset = _aligned(offset + nbytes)
    return {"version": version, "tensors": entries}, offset


def _write_and_check(
    path: Path, header: dict[str, Any], tensors: Mapping[str, Tensor], size: int
) -> None:
    """`_write_region`, then the `shm_upload` fault window (written, not renamed)."""
    _write_region(path, header, tensors, size)
    fault_point("shm_upload", header["version"])


def _write_region(
    path: Path, header: dict[str, Any], tensors: Mapping[str, Tensor], size: int
) -> None:
    import torch

    blob = json.dumps(header).encode()
    data_start = _aligned(_HEADER_LENGTH.size + len(blob))
    with path.open("wb") as out:
        out.write(_HEADER_LENGTH.pack(len(blob)) + blob)
        for name, tensor in tensors.items():
            out.seek(data_start + header["tensors"][name]["offset"])
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            out.write(flat.view(torch.uint8).numpy().data)
        out.truncate(data_start + size)


def _read_header(path: Path, region: mmap.mmap, version: int) -> tuple[dict[str, Any], int]:
    """The header of `region` (mapped from `path`) and where its data starts.

    Raises `ShmWeightsError` unless the region holds `version` whole.
    """
    (length,) = _HEADER_LENGTH.unpack(region[: _HEADER_LENGTH.size])
    header = json.loads(region[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
    data_start = _aligned(_HEADER_LENGTH.size + length)
    if header.get("version") != version:
        raise ShmWeightsError(
            f"{path} holds weights version {header.get('version')}, not {version}"
        )
    entries = header["tensors"].values()
    needed = data_start + max((e["offset"] + e["nbytes"] for e in entries), default=0)
    if len(region) < needed:
        raise ShmWeightsError(
            f"{path} is {len(region)} bytes, shorter than its header needs ({needed})"
        )
    return header, data_start


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
