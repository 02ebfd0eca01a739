"""Shared by the algorithm functions: registries and their lookup, shape and finiteness checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, get_args

import torch
from torch import Tensor

T = TypeVar("T")
K = TypeVar("K", bound=str)


def registry(names: Any, entries: dict[K, T]) -> dict[K, T]:
    """`entries`, which must implement exactly the names of the Literal `names` (the config's
    choices); a RuntimeError naming what is missing or extra otherwise, raised on import."""
    wanted, given = set(get_args(names)), set(entries)
    if wanted != given:
        raise RuntimeError(
            f"registry of {sorted(wanted)}: missing {sorted(wanted - given)}, "
            f"extra {sorted(given - wanted)}"
        )
    return entries


def lookup(registry: Mapping[Any, T], name: str, kind: str) -> T:
    """The entry `name` of `registry`; a ValueError listing the known names otherwise."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def check_2d(name: str, tensor: Tensor, shape: torch.Size | None = None) -> None:
    """Raise a ValueError unless `tensor` is [B, T] (and equal to `shape` when given)."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(tensor.shape)}")
    if shape is not None and tensor.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (the mask's shape)"
        )


def check_mask(mask: Tensor) -> None:
    """Raise a ValueError unless `mask` is a [B, T] bool or float tensor without NaN/inf."""
    check_2d("mask", mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"mask must be bool or floating point, got {mask.dtype}")
    if mask.is_floating_point() and not bool(torch.isfinite(mask).all()):
        raise ValueError("mask contains NaN or inf")


def check_finite(name: str, tensor: Tensor, where: Tensor | None = None) -> None:
    """Raise a ValueError naming `name` if it holds NaN/inf (only at `where` when given)."""
    values = tensor if where is None else tensor[where]
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        scope = "" if where is None else " at masked positions"
        count = int(bad.sum())
        raise ValueError(f"{name} contains {count} NaN/inf value(s){scope}")


def bool_mask(mask: Tensor) -> Tensor:
    """The positions that count: True where `mask` is non-zero."""
    return mask if mask.dtype == torch.bool else mask != 0
