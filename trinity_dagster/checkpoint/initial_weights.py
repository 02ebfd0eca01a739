"""Weights version 0: a tiny Llama built from `config.model`, or a copy of `model.path`.

The result is a complete Hugging Face directory (config, safetensors weights, tokenizer) at
`published_weights_dir(paths, 0)`, the tokenizer also at `paths.tokenizer`, and the
published-weights marker at 0 (unless a newer version is already published). The directory is
built in a `.global_step_0.tmp-*` scratch directory beside its target and renamed into place,
so a crash never leaves a half-written version 0.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trinity_dagster.checkpoint.hf_dir import is_complete_hf_dir
from trinity_dagster.checkpoint.layout import (
    discard_dir,
    latest_weights_version,
    published_weights_dir,
    scratch_dir,
    set_latest_weights_version,
)
from trinity_dagster.config import ModelConfig, TrinityConfig
from trinity_dagster.files import fsync_dir
from trinity_dagster.paths import RunPaths
from trinity_dagster.tokenizer import build_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerBase

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def create_initial_model(config: TrinityConfig, paths: RunPaths) -> Path:
    """Create (or keep an existing complete) weights version 0 and return its directory.

    Processes that start together (engine ranks, explorers) take turns under a file lock.
    """
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.initial_weights_lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _create_initial_model(config, paths)


def create_initial_model_apart(config: TrinityConfig, paths: RunPaths) -> Path:
    """`create_initial_model`, made by a forked child process when there is anything to make,
    so that what making it imports stays out of this process: transformers' model classes and
    with them torch's compiler stack (43 MB and about 1 s in an engine rank, which never uses
    them again). Its errors are raised here. Call it before this process starts threads; a
    process that initialised CUDA, which a forked child cannot use, makes it itself.
    """
    if _is_made(paths) or torch.cuda.is_initialized():
        return create_initial_model(config, paths)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_create_in_child, args=(config, paths, send), name="initial-weights"
    )
    child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:
        outcome = RuntimeError(
            f"making weights version 0 under {paths.root} failed: its process exited with "
            f"{child.exitcode} before it reported"
        )
    finally:
        receive.close()
        child.join()
    if isinstance(outcome, BaseException):
        raise outcome
    return Path(outcome)


def _is_made(paths: RunPaths) -> bool:
    """Whether version 0, the saved tokenizer and the weights marker are all there."""
    return (
        is_complete_hf_dir(published_weights_dir(paths, 0))
        and (paths.tokenizer / "tokenizer_config.json").is_file()
        and latest_weights_version(paths) is not None
    )


def _create_in_child(config: TrinityConfig, paths: RunPaths, send: Any) -> None:
    """The child of `create_initial_model_apart`: sends the directory made, or the error."""
    torch.set_num_threads(1)  # no thread pool of the parent's is used after the fork
    try:
        send.send(str(create_initial_model(config, paths)))
    except BaseException as err:  # reported to the parent, which raises it
        try:
            send.send(err)
        except Exception:  # an error that does not pickle: its type and message
            send.send(RuntimeError(f"{type(err).__name__}: {err}"))
    finally:
        send.close()


def _create_initial_model(config: TrinityConfig, paths: RunPaths) -> Path:
    target = published_weights_dir(paths, 0)
    if not is_complete_hf_dir(target):
        if target.exists():
            discard_dir(target, 0)
        staging = scratch_dir(target.parent, 0)
        staging.mkdir(parents=True)
        try:
            if config.model.path is None:
                _build_tiny_model(config, staging)
            else:
                _copy_model(Path(config.model.path), staging)
            staging.rename(target)
            fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if not (paths.tokenizer / "tokenizer_config.json").is_file():
        load_tokenizer(target).save_pretrained(str(paths.tokenizer))
    if latest_weights_version(paths) is None:
        set_latest_weights_version(paths, 0)
    return target


def llama_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The Hugging Face config of the tiny model described by `model` for `tokenizer`."""
    from transformers import LlamaConfig

    vocab_size = model.vocab_size if model.vocab_size is not None else len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's {len(tokenizer)} "
            "tokens; leave it unset to take the tokenizer's size"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        max_position_embeddings=model.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        rms_norm_eps=model.rms_norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _build_tiny_model(config: TrinityConfig, out_dir: Path) -> None:
    # transformers' model classes import torch's compiler stack: only where a model is built
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    hf_config = llama_config(config.model, tokenizer)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.trainer.seed)
        model = LlamaForCausalLM(hf_config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def _copy_model(source: Path, out_dir: Path) -> None:
    where = f"model.path {source}"
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{where}: not a Hugging Face model directory (no config.json)")
    hf_config = json.loads(config_file.read_text())
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; expected one of "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    if not any(source.glob("*.safetensors")):
        raise FileNotFoundError(f"{where}: no *.safetensors weights")
    tokenizer = load_tokenizer(source)
    if hf_config.get("vocab_size", 0) < len(tokenizer):
        raise ValueError(
            f"{where}: vocab_size {hf_config.get('vocab_size')} is smaller than its tokenizer's "
            f"{len(tokenizer)} tokens"
        )
    shutil.copytree(source, out_dir, dirs_exist_ok=True)
