"""Megatron core attention computed by `torch.nn.functional.scaled_dot_product_attention`.

`SDPAttention` is a drop-in for Megatron-core's local `DotProductAttention` (same constructor
and forward signature, same `[sq, b, np, hn]` inputs and `[sq, b, hp]` output) for the local
layer spec: SDPA runs a fused kernel on CPU and GPU instead of explicit QK^T, softmax and AV
matmuls. It holds no parameters, so checkpoints are unchanged.

Masks follow Megatron: `attention_mask` is boolean, True where attention is NOT allowed,
broadcastable to `[b, np, sq, sk]`; `None` with a causal `attn_mask_type` means plain causal
attention. A query row whose keys are all masked yields zeros (Megatron's softmax yields a
uniform average there); such rows are padding and carry no loss.

Packed sequences (Megatron's `thd` format, `packed_seq_params` with `cu_seqlens`) are
attended one sequence at a time, each causal within itself.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Core attention (softmax(QK^T * scale + mask) V) for one tensor-parallel rank's heads."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size > 1": config.context_parallel_size != 1,
            f"softmax_type {config.softmax_type!r}": config.softmax_type != "vanilla",
            "window_size (sliding-window attention)": is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, layer_number
            ),
        }
        for what, bad in unsupported.items():
            if bad:
                raise ValueError(f"SDPAttention (layer {layer_number}): {what} is not supported")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        if attention_dropout is None:
            attention_dropout = config.attention_dropout
        self.dropout_p = attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Context `[sq, b, np * hn]` from query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]`;
        for packed sequences (`thd`), `[t, np * hn]` from `[t, np, hn]` and `[t, ng, hn]`."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        expected = {
            "query": self.num_attention_heads_per_partition,
            "key": self.num_query_groups_per_partition,
            "value": self.num_query_groups_per_partition,
        }
        heads_dim = 2 if packed_seq_params is None else 1
        for name, tensor in zip(expected, (query, key, value), strict=True):
            if tensor.size(heads_dim) != expected[name]:
                raise ValueError(
                    f"SDPAttention: {name} has {tensor.size(heads_dim)} heads, expected "
                    f"{expected[name]} per tensor-parallel rank"
                )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type)
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            allowed, causal = None, mask_type == AttnMaskType.causal
        else:
            allowed, causal = _allowed(attention_mask, q.size(2), k.size(2)), False
        context = self._sdpa(q, k, v, allowed, causal)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        sq, batch = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams,
        mask_type: AttnMaskType,
    ) -> torch.Tensor:
        """Context `[t, np * hn]` of sequences packed back to back (`thd`: `[t, heads, hn]`),
        each attending only to itself."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention: packed format {params.qkv_format!r} is not 'thd'")
        if params.cu_seqlens_kv is not params.cu_seqlens_q and not torch.equal(
            params.cu_seqlens_kv, params.cu_seqlens_q
        ):
            raise ValueError("SDPAttention: packed queries and keys must share cu_seqlens")
        bounds = params.cu_seqlens_q.tolist()
        if bounds[-1] != query.size(0):
            raise ValueError(
                f"SDPAttention: cu_seqlens cover {bounds[-1]} tokens, the packed query has "
                f"{query.size(0)}"
            )
        # [t, heads, hn] -> [heads, t, hn]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal
        pieces = [
            self._sdpa(q[:, a:b], k[:, a:b], v[:, a:b], None, causal) for a, b in pairwise(bounds)
        ]
        # [np, t, hn] -> [t, np * hn]
        return torch.cat(pieces, dim=1).transpose(0, 1).reshape(query.size(0), -1)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """SDPA over `[..., heads, s, hn]` with this layer's scale and dropout."""
        dropout_p = self.dropout_p if self.training else 0.0
        with _dropout_rng(dropout_p, self.config.sequence_parallel):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=k.size(-3) != q.size(-3),
            )


def _allowed(attention_mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """SDPA's boolean mask (True = may attend) from Megatron's (True = masked)."""
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"SDPAttention: attention_mask must be boolean (True = masked), "
            f"got {attention_mask.dtype}"
        )
    if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (sq, sk):
        raise ValueError(
            f"SDPAttention: attention_mask shape {tuple(attention_mask.shape)} is not "
            f"[b, 1, {sq}, {sk}]"
        )
    return ~attention_mask


def _dropout_rng(dropout_p: float, sequence_parallel: bool) -> AbstractContextManager:
    """The RNG context Megatron's DotProductAttention uses for attention dropout."""
    if dropout_p == 0.0 or sequence_parallel:
        return nullcontext()
    return tensor_parallel.get_cuda_rng_tracker().fork()
