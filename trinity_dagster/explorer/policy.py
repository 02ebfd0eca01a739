"""Loading published weights as a rollout policy: `transformers`, fp32, CPU, eval mode."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from trinity_dagster.checkpoint.layout import latest_weights_version, weights_dir
from trinity_dagster.checkpoint.weights_holds import hold_weights
from trinity_dagster.paths import RunPaths

T = TypeVar("T")


def resolve_version(paths: RunPaths, version: int | None) -> int:
    """`version`, or the newest published one when None; a clear error if none is published."""
    if version is not None:
        if version < 0:
            raise ValueError(f"weights version must be >= 0, got {version}")
        return version
    latest = latest_weights_version(paths)
    if latest is None:
        raise FileNotFoundError(
            f"no published weights under {paths.root}: create version 0 first "
            "(trinity_dagster.checkpoint.initial_weights.create_initial_model)"
        )
    return latest


def load_policy(paths: RunPaths, version: int) -> PreTrainedModel:
    """The model of weights `version` in fp32 on the CPU, in eval mode (see `_read_held`)."""
    return _read_held(paths, version, load_policy_dir)


def read_policy_weights(paths: RunPaths, version: int) -> dict[str, torch.Tensor]:
    """The HF-named tensors of weights `version`, read from its safetensors files (see
    `_read_held`): what `copy_weights_into` takes to update a loaded model in place."""
    return _read_held(paths, version, read_weights_dir)


def read_weights_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor in HF directory `directory`'s safetensors files (one file or shards)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except SafetensorError as err:
            raise ValueError(f"weights file {file} is not readable safetensors: {err}") from err
    return tensors


def _read_held(paths: RunPaths, version: int, read: Callable[[Path], T]) -> T:
    """`read` of the HF directory of weights `version`, the version held against pruning
    while it reads. A version pruned just before the hold took effect is read from a kept
    checkpoint's export if there is one."""
    with hold_weights(paths, version):
        try:
            return read(weights_dir(paths, version))
        except FileNotFoundError:  # pruned between the look-up and the hold: look again
            try:
                directory = weights_dir(paths, version)
            except FileNotFoundError as err:
                raise FileNotFoundError(
                    f"weights version {version} are no longer on disk: pruned "
                    "(synchronizer.keep_synced_weights) and no kept checkpoint of that step "
                    f"has an HF export ({err})"
                ) from None
            return read(directory)


def load_policy_dir(directory: Path) -> PreTrainedModel:
    """The model saved in HF directory `directory` in fp32 on the CPU, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model.cpu().eval()


def copy_weights_into(model: PreTrainedModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named `tensors` into `model` in place; every weight must be given (or tied)."""
    result = model.load_state_dict(dict(tensors), strict=False)
    own = model.state_dict()
    given = {own[name].data_ptr() for name in tensors if name in own}
    untied = [name for name in result.missing_keys if own[name].data_ptr() not in given]
    if untied or result.unexpected_keys:
        raise ValueError(
            f"weights do not match the explorer's model: missing {untied or 'none'}, "
            f"unknown {result.unexpected_keys or 'none'}"
        )
