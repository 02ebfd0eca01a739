"""The Hugging Face directory of a weights version, as explorers and vLLM load it.

    model.safetensors        every tensor under its HF name
    config.json              the model's HF config, `torch_dtype` set to the tensors' dtype
    generation_config.json   the source model's, when it has one
    tokenizer files          the source model's (`TOKENIZER_FILES`)

`write_hf_dir` is the one writer of this format: a checkpoint's `huggingface/` export, the
published weights of a sync and `convert` all go through it, so explorers get the same
directory whichever way the weights reach them. torch and safetensors are imported when
writing, so this module is cheap to import.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trinity_dagster.checkpoint.shared_files import SharedFiles
from trinity_dagster.files import fsync_dir, write_file_atomic, write_file_synced

if TYPE_CHECKING:
    from torch import Tensor

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
SHARDED_WEIGHTS_GLOB = "model-*-of-*.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_DTYPE_KEYS = ("dtype", "torch_dtype")
_FileWriter = Callable[[Path, Callable[[Path], object]], None]


def hf_dir_written(directory: Path) -> bool:
    """Whether `write_hf_dir` finished writing `directory`: its `config.json` comes last."""
    return (directory / CONFIG_FILE).is_file()


def is_complete_hf_dir(directory: Path) -> bool:
    """Whether `directory`, from anywhere, holds an HF model whole: a config, safetensors
    weights and a tokenizer."""
    return (
        (directory / CONFIG_FILE).is_file()
        and any(directory.glob("*.safetensors"))
        and (directory / "tokenizer_config.json").is_file()
    )


def write_hf_dir(
    out_dir: Path,
    tensors: Mapping[str, Tensor],
    hf_config: Mapping[str, Any],
    source_dir: Path | None,
    *,
    fresh: bool = False,
    shared: SharedFiles | None = None,
) -> Path:
    """Write `tensors` with `hf_config` as an HF directory `out_dir`; returns `out_dir`.

    `source_dir` is the HF directory the model came from: its tokenizer files and generation
    config are copied. Every file is replaced atomically and fsynced, `config.json` last, so a
    directory with a `config.json` is complete. Sharded weights of an earlier write are removed.
    `fresh`: `out_dir` must not exist; it is created, its files are written in place and
    fsynced, then the directory: for a directory renamed into place once whole (a publish).
    `shared` (with `fresh`): the config and the source's files are hard links to the copies
    this store keeps, written once (`shared_files`).
    """
    if shared is not None and not fresh:
        raise ValueError("write_hf_dir: shared files are for a fresh directory only")
    if source_dir is not None and not Path(source_dir).is_dir():
        raise FileNotFoundError(
            f"source directory {source_dir} of the tokenizer files for {out_dir} does not exist"
        )
    cpu = _cpu_tensors(tensors, out_dir)
    config_text = _config_text(hf_config, cpu, out_dir)
    out_dir.mkdir(parents=True, exist_ok=not fresh)
    for stale in [out_dir / WEIGHTS_INDEX_FILE, *out_dir.glob(SHARDED_WEIGHTS_GLOB)]:
        stale.unlink(missing_ok=True)
    write = write_file_synced if fresh else write_file_atomic
    _write_weights(out_dir / WEIGHTS_FILE, cpu, write)
    for name, source in _model_files(source_dir):
        if shared is None:
            write(out_dir / name, partial(shutil.copyfile, source))
        else:
            shared.place_copy(out_dir / name, source)
    if shared is None:
        write(out_dir / CONFIG_FILE, lambda path: path.write_text(config_text))
    else:
        shared.place(out_dir / CONFIG_FILE, config_text.encode())
    if fresh:
        fsync_dir(out_dir)
    return out_dir


def _cpu_tensors(tensors: Mapping[str, Tensor], out_dir: Path) -> dict[str, Tensor]:
    """Contiguous CPU copies where needed; tensors sharing storage are cloned (safetensors)."""
    import torch

    if not tensors:
        raise ValueError(
            f"no tensors given for {out_dir} (of a multi-rank engine only global rank 0 has them)"
        )
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights for {out_dir}: entry {name!r} must map a str to a torch.Tensor, "
                f"got {type(tensor).__name__}"
            )
        t = tensor.detach().to("cpu").contiguous()
        if _storage_key(t) in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(_storage_key(t))
        out[name] = t
    return out


def _storage_key(tensor: Tensor) -> tuple[int, int]:
    """Where `tensor`'s data starts: its storage's address and its offset in that storage."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())


def _config_text(hf_config: Mapping[str, Any], tensors: dict[str, Tensor], out_dir: Path) -> str:
    """`hf_config` as JSON, its dtype keys (`torch_dtype` if none) naming the tensors' dtype."""
    config = dict(hf_config)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    for key in [k for k in _DTYPE_KEYS if k in config] or ["torch_dtype"]:
        config[key] = dtype
    try:
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as err:
        raise ValueError(f"hf_config is not JSON-serializable (for {out_dir}): {err}") from None


def _write_weights(path: Path, tensors: dict[str, Tensor], write: _FileWriter) -> None:
    from safetensors.torch import save_file

    write(path, lambda target: save_file(tensors, target, metadata={"format": "pt"}))


def _model_files(source_dir: Path | None) -> list[tuple[str, Path]]:
    """(name, path) of the tokenizer files and generation config that `source_dir` has."""
    if source_dir is None:
        return []
    found = [(name, Path(source_dir) / name) for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE)]
    return [(name, path) for name, path in found if path.is_file()]
