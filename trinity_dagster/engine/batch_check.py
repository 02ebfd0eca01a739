"""Validation of a training batch before it can touch the weights.

A batch is the dict of tensors made by `trinity_dagster.buffer.reader.to_tensors`. Every
problem raises `BatchError`, whose message names the field and, where one is at fault, the row.
"""

from __future__ import annotations

import torch
from torch import Tensor

REQUIRED_2D = ("tokens", "attention_mask", "response_mask", "old_logprobs")
OPTIONAL_2D = ("advantages",)
REQUIRED_1D = ("rewards", "group_index")
OPTIONAL_1D = ("model_version",)


class BatchError(ValueError):
    """A training batch is unusable; the message names the field and row at fault."""


def check_batch(
    batch: dict[str, Tensor], *, max_model_len: int, vocab_size: int, data_parallel_size: int = 1
) -> None:
    """Raise `BatchError` unless `batch` is a well-formed, finite, trainable batch.

    Checks: required fields present and tensors of the right rank, dtype and shape; at least
    one row, and a row count divisible by `data_parallel_size`; right-padded attention masks;
    no sequence longer than `max_model_len`; token ids in `[0, vocab_size)`; response tokens
    inside the attended prefix and never at position 0; at least one response token per row;
    finite rewards, old log-probs and advantages.
    """
    if not isinstance(batch, dict):
        raise BatchError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    for name in REQUIRED_2D + REQUIRED_1D:
        if name not in batch:
            raise BatchError(f"batch field {name!r} is missing (have: {sorted(batch)})")
    for name in REQUIRED_2D + OPTIONAL_2D + REQUIRED_1D + OPTIONAL_1D:
        if name in batch and batch[name] is not None and not isinstance(batch[name], Tensor):
            raise BatchError(
                f"batch field {name!r} must be a torch.Tensor, got {type(batch[name]).__name__}"
            )

    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise BatchError(f"batch field 'tokens' must be [B, L], got shape {tuple(tokens.shape)}")
    rows, length = tokens.shape
    if rows == 0 or length == 0:
        raise BatchError(f"batch is empty: 'tokens' has shape {tuple(tokens.shape)}")
    if rows % data_parallel_size:
        raise BatchError(
            f"batch has {rows} rows, not divisible by the data-parallel size {data_parallel_size}"
        )
    _check_shapes(batch, rows, length)
    _check_dtypes(batch)

    attention = batch["attention_mask"]
    response = batch["response_mask"]
    lengths = attention.sum(dim=1)
    _first_bad(lengths == 0, "attention_mask", "no attended tokens")
    prefix = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    _first_bad(
        (attention != prefix).any(dim=1),
        "attention_mask",
        "not right-padded (attended positions must be a prefix)",
    )
    too_long = lengths > max_model_len
    if bool(too_long.any()):
        row = int(too_long.nonzero()[0])
        raise BatchError(
            f"batch field 'tokens' row {row}: sequence of {int(lengths[row])} tokens is longer "
            f"than model.max_model_len ({max_model_len})"
        )
    _first_bad((response & ~attention).any(dim=1), "response_mask", "marks padding positions")
    _first_bad(
        response[:, 0],
        "response_mask",
        "position 0 cannot be a response token (it has no preceding context)",
    )
    _first_bad(~response.any(dim=1), "response_mask", "no response tokens")
    _first_bad(
        (attention & ((tokens < 0) | (tokens >= vocab_size))).any(dim=1),
        "tokens",
        f"token id outside the vocabulary [0, {vocab_size})",
    )
    for name in ("rewards", "old_logprobs", "advantages"):
        value = batch.get(name)
        if value is not None:
            bad = ~torch.isfinite(value)
            _first_bad(bad if bad.dim() == 1 else bad.any(dim=1), name, "contains NaN or inf")


def _first_bad(bad_rows: Tensor, name: str, problem: str) -> None:
    """Raise `BatchError` naming `name` and the first row flagged in `bad_rows`."""
    if bool(bad_rows.any()):
        row = int(bad_rows.nonzero()[0])
        raise BatchError(f"batch field {name!r} row {row}: {problem}")


def _check_shapes(batch: dict[str, Tensor], rows: int, length: int) -> None:
    for name in REQUIRED_2D + OPTIONAL_2D:
        value = batch.get(name)
        if value is not None and tuple(value.shape) != (rows, length):
            raise BatchError(
                f"batch field {name!r} has shape {tuple(value.shape)}, expected {(rows, length)} "
                "(the shape of 'tokens')"
            )
    for name in REQUIRED_1D + OPTIONAL_1D:
        value = batch.get(name)
        if value is not None and tuple(value.shape) != (rows,):
            raise BatchError(
                f"batch field {name!r} has shape {tuple(value.shape)}, expected {(rows,)} "
                "(one per row of 'tokens')"
            )


def _check_dtypes(batch: dict[str, Tensor]) -> None:
    for name in ("attention_mask", "response_mask"):
        if batch[name].dtype != torch.bool:
            raise BatchError(f"batch field {name!r} must be bool, got {batch[name].dtype}")
    for name in ("tokens", "group_index"):
        if batch[name].is_floating_point() or batch[name].dtype == torch.bool:
            raise BatchError(f"batch field {name!r} must be integer, got {batch[name].dtype}")
    for name in ("old_logprobs", "rewards", "advantages"):
        value = batch.get(name)
        if value is not None and not value.is_floating_point():
            raise BatchError(f"batch field {name!r} must be floating point, got {value.dtype}")
