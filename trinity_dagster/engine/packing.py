"""Sequence packing: a right-padded micro-batch's rows laid back to back, with no padding.

With `trainer.sequence_packing`, a micro-batch `[b, L]` becomes one sequence `[1, S]` of its
`S = sum(lengths)` real tokens (verl's `use_remove_padding`). Each row still attends only to
itself and its positions restart at 0, so the per-token results are those of the padded
layout; the model does no work on padding. `Packing` records where each row lies, to pack
inputs and to scatter per-token outputs back to `[b, L]` (zeros at padding) for the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Where the rows of one right-padded `[rows, length]` micro-batch lie when packed."""

    rows: int
    length: int
    cu_seqlens: Tensor  # int32 [rows + 1]: row i is packed[cu_seqlens[i] : cu_seqlens[i + 1]]
    max_seqlen: int
    index: Tensor  # int64 [S]: the flat [rows * length] position of each packed token

    @classmethod
    def of(cls, attention_mask: Tensor) -> Packing:
        """The packing of a right-padded micro-batch (`attention_mask` [rows, length])."""
        rows, length = attention_mask.shape
        lengths = attention_mask.sum(dim=1)
        cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=attention_mask.device)
        torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
        return cls(
            rows=rows,
            length=length,
            cu_seqlens=cu_seqlens,
            max_seqlen=int(lengths.max()),
            index=attention_mask.reshape(-1).nonzero().squeeze(1),
        )

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed sequence."""
        return int(self.index.numel())

    def pack(self, values: Tensor) -> Tensor:
        """`[1, S, ...]`: the real positions of `values` [rows, length, ...], row after row."""
        return values.flatten(0, 1)[self.index].unsqueeze(0)

    def unpack(self, packed: Tensor) -> Tensor:
        """`[rows, length, ...]` from `packed` [1, S, ...], zeros at padding (differentiable)."""
        values = packed.squeeze(0)
        flat = values.new_zeros(self.rows * self.length, *values.shape[1:])
        return flat.index_copy(0, self.index, values).view(
            self.rows, self.length, *values.shape[1:]
        )

    def positions(self) -> Tensor:
        """`[1, S]`: each token's position within its own row."""
        return (self.index % self.length).unsqueeze(0)

    def seq_params(self) -> PackedSeqParams:
        """Megatron's description of this packing (the `thd` format)."""
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def split_micro_batches(local: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """`local`'s right-padded rows in pieces of `size` rows, each cut to its longest row."""
    rows = local["tokens"].shape[0]
    pieces = []
    for start in range(0, rows, size):
        piece = {key: value[start : start + size] for key, value in local.items()}
        length = int(piece["attention_mask"].sum(dim=1).max())
        pieces.append({key: value[:, :length].contiguous() for key, value in piece.items()})
    return pieces
