"""Megatron-core GPT models built from Llama/Qwen2-style Hugging Face `config.json` dicts.

Supported: RMSNorm, SwiGLU MLP, RoPE (`rope_theta`, no scaling), grouped-query attention,
tied or untied embeddings, and Qwen2's q/k/v biases. Llama's `attention_bias` is rejected
because it also adds an output-projection bias.

The vocabulary is padded to a multiple of the tensor-parallel size; the padded rows of the
embedding and output layer hold zeros, and the logit functions here mask or strip them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.cpu_compat import cpu_compat_active
from trinity_dagster.engine.packing import Packing
from trinity_dagster.engine.sdpa_attention import SDPAttention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_PADDED_LOGIT = -1.0e30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The HF config describes a model this engine cannot build; the message names the key."""


def _require(hf_config: dict[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise UnsupportedModelError(f"HF config.json: missing required key {key!r}")
    return hf_config[key]


def check_hf_config(hf_config: dict[str, Any]) -> None:
    """Raise UnsupportedModelError if `hf_config` is not a supported Llama/Qwen2 config."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"HF config.json: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        _require(hf_config, key)
    _require(hf_config, "intermediate_size")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"HF config.json: hidden_act {act!r} is not supported (silu)")
    if hf_config.get("rope_scaling"):
        raise UnsupportedModelError(
            f"HF config.json: rope_scaling {hf_config['rope_scaling']!r} is not supported"
        )
    rope_type = (hf_config.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModelError(
            f"HF config.json: rope_parameters.rope_type {rope_type!r} is not supported (default)"
        )
    if hf_config.get("mlp_bias"):
        raise UnsupportedModelError("HF config.json: mlp_bias true is not supported")
    if model_type == "llama" and hf_config.get("attention_bias"):
        raise UnsupportedModelError(
            "HF config.json: attention_bias true is not supported for llama (o_proj bias)"
        )
    if model_type == "qwen2" and hf_config.get("use_sliding_window"):
        raise UnsupportedModelError("HF config.json: use_sliding_window true is not supported")
    heads = hf_config["num_attention_heads"]
    groups = hf_config.get("num_key_value_heads") or heads
    if heads % groups:
        raise UnsupportedModelError(
            f"HF config.json: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({groups})"
        )


def head_dim(hf_config: dict[str, Any]) -> int:
    """Channels per attention head."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def num_query_groups(hf_config: dict[str, Any]) -> int:
    """Key/value heads (grouped-query attention)."""
    return hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]


def rope_theta(hf_config: dict[str, Any]) -> float:
    """The RoPE base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta`."""
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def has_qkv_bias(hf_config: dict[str, Any]) -> bool:
    """Whether q/k/v projections carry a bias (Qwen2)."""
    return hf_config["model_type"] == "qwen2"


def tied_embeddings(hf_config: dict[str, Any]) -> bool:
    """Whether the output layer shares the input embedding's weight."""
    return bool(hf_config.get("tie_word_embeddings", hf_config["model_type"] == "llama"))


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """`vocab_size` rounded up to a multiple of the tensor-parallel size."""
    return -(-vocab_size // tp_size) * tp_size


def to_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ("float32", "bfloat16", "float16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"params_dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def transformer_config_from_hf(
    hf_config: dict[str, Any],
    megatron_cfg: MegatronConfig,
    *,
    params_dtype: torch.dtype | str = torch.float32,
) -> TransformerConfig:
    """The Megatron TransformerConfig equivalent to a Llama/Qwen2 HF config."""
    check_hf_config(hf_config)
    dtype = to_torch_dtype(params_dtype)
    tp = megatron_cfg.tensor_model_parallel_size
    groups = num_query_groups(hf_config)
    if groups % tp or hf_config["num_attention_heads"] % tp:
        raise UnsupportedModelError(
            f"megatron.tensor_model_parallel_size {tp} must divide num_attention_heads "
            f"({hf_config['num_attention_heads']}) and num_key_value_heads ({groups})"
        )
    return TransformerConfig(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_query_groups=groups,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf_config.get("initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        sequence_parallel=megatron_cfg.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=cpu_compat_active(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(
    hf_config: dict[str, Any],
    megatron_cfg: MegatronConfig,
    *,
    params_dtype: torch.dtype | str = torch.float32,
) -> GPTModel:
    """This rank's part of a Megatron GPTModel for `hf_config` (parallel state must be set)."""
    config = transformer_config_from_hf(hf_config, megatron_cfg, params_dtype=params_dtype)
    if megatron_cfg.transformer_impl == "transformer_engine":
        if cpu_compat_active():
            raise ValueError(
                "megatron.transformer_impl 'transformer_engine' needs a GPU; use 'local' on CPU"
            )
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = local_layer_spec()
    vocab = hf_config["vocab_size"]
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(vocab, megatron_cfg.tensor_model_parallel_size),
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=tied_embeddings(hf_config),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    model.hf_vocab_size = vocab
    # Megatron's local RMSNorm makes its weight in the default dtype; in bf16/fp16 every
    # parameter must share the dtype (as Megatron's Float16Module casts the whole model), or
    # the mixed-precision optimizer pairs its fp32 copies with the wrong parameters.
    model.to(config.params_dtype)
    if model.post_process and not model.output_layer.sequence_parallel:
        _make_output_layer_batch_first(model.output_layer)
    if not cpu_compat_active():
        model.cuda(torch.cuda.current_device())
    _zero_padded_vocab_rows(model, vocab)
    return model


def local_layer_spec() -> ModuleSpec:
    """Megatron's local RMSNorm GPT layer spec with `SDPAttention` as core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


def _make_output_layer_batch_first(output_layer: torch.nn.Module) -> None:
    """Compute the logits batch-first, so GPTModel's `[s, b, V] -> [b, s, V]` copy vanishes.

    GPTModel returns `logits.transpose(0, 1).contiguous()`; copying the (large) logits there
    and back in the backward pass costs more than transposing the hidden states. The hooks
    feed the output layer `[b, s, h]` and hand GPTModel an `[s, b, V]` view of the `[b, s, V]`
    result, whose transpose is already contiguous. Needs no sequence parallelism (the output
    layer would gather the sequence along dim 0).
    """

    def to_batch_first(_module, args, kwargs):
        return (args[0].transpose(0, 1).contiguous(), *args[1:]), kwargs

    def to_sequence_first_view(_module, _args, _kwargs, output):
        logits, bias = output
        return logits.transpose(0, 1), bias

    output_layer.register_forward_pre_hook(to_batch_first, with_kwargs=True)
    output_layer.register_forward_hook(to_sequence_first_view, with_kwargs=True)


def _zero_padded_vocab_rows(model: GPTModel, vocab: int) -> None:
    """Zero the embedding/output rows of padded vocabulary entries on this rank."""
    start, end = _vocab_range(model)
    keep = max(0, min(end, vocab) - start)
    with torch.no_grad():
        if model.pre_process:
            model.embedding.word_embeddings.weight[keep:].zero_()
        if model.post_process and not model.share_embeddings_and_output_weights:
            model.output_layer.weight[keep:].zero_()


def _vocab_range(model: GPTModel) -> tuple[int, int]:
    """The [start, end) slice of the padded vocabulary held by this TP rank."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    per_rank = model.vocab_size // tp
    return rank * per_rank, (rank + 1) * per_rank


def unwrap_model(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP/Float16 wrappers (anything exposing `.module`)."""
    while not isinstance(model, GPTModel):
        inner = getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"{type(model).__name__} is not (a wrapper of) a Megatron GPTModel")
        model = inner
    return model


def hf_vocab_size(model: GPTModel) -> int:
    """The unpadded vocabulary size of a model made by `build_gpt_model`."""
    model = unwrap_model(model)
    if not hasattr(model, "hf_vocab_size"):
        raise AttributeError("the model was not built by build_gpt_model (no hf_vocab_size)")
    return model.hf_vocab_size


def causal_attention_mask(
    batch: int, seq: int, padding_mask: torch.Tensor | None = None, device: Any = None
) -> torch.Tensor:
    """Megatron's boolean mask [B, 1, T, T], True where attention is NOT allowed.

    Causal, and when `padding_mask` [B, T] (1/True = real token) is given, padded keys are
    masked too.
    """
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
    mask = causal.expand(batch, 1, seq, seq)
    if padding_mask is not None:
        if padding_mask.shape != (batch, seq):
            raise ValueError(
                f"attention_mask shape {tuple(padding_mask.shape)} != tokens shape {(batch, seq)}"
            )
        mask = mask | ~padding_mask.bool().to(mask.device)[:, None, None, :]
    return mask.contiguous()


def local_logits(
    model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """This TP rank's vocabulary shard of the logits, [B, T, V_padded / tp].

    Padded vocabulary columns are set to -1e30, so a (vocab-parallel) softmax gives them
    zero probability. `attention_mask` is a [B, T] padding mask (1 = real token); positions
    are 0..T-1 (right padding). Needs pipeline-parallel size 1.
    """
    return _mask_padded_vocab(unwrap_model(model), padded_forward(model, tokens, attention_mask))


def padded_forward(
    model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's output [B, T, ...] for right-padded rows `tokens` [B, T] (`attention_mask`:
    1 = real token), positions 0..T-1. Needs pipeline-parallel size 1."""
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("the forward needs pipeline_model_parallel_size 1; use the schedules")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    batch, seq = tokens.shape
    if attention_mask is not None and attention_mask.shape != (batch, seq):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != tokens shape {(batch, seq)}"
        )
    gpt = unwrap_model(model)
    device = next(gpt.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = None  # no padding: the core attention applies the causal mask itself (fast path)
    if attention_mask is not None and not bool(attention_mask.all()):
        mask = causal_attention_mask(batch, seq, attention_mask, device=device)
    return model(input_ids=tokens, position_ids=positions, attention_mask=mask)


def packed_local_logits(
    model: torch.nn.Module, tokens: torch.Tensor, packing: Packing
) -> torch.Tensor:
    """This TP rank's vocabulary shard of the logits, [1, S, V_padded / tp], of the rows that
    `packing` laid back to back in `tokens` [1, S].

    Each row attends only to itself and its positions start at 0, as in `local_logits` of the
    padded rows. Needs pipeline-parallel size 1 and no sequence parallelism.
    """
    return _mask_padded_vocab(unwrap_model(model), packed_forward(model, tokens, packing))


def packed_forward(model: torch.nn.Module, tokens: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The model's output [1, S, ...] for the rows `packing` laid back to back in `tokens`
    [1, S]. Needs pipeline-parallel size 1 and no sequence parallelism."""
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("the packed forward needs pipeline_model_parallel_size 1")
    if tuple(tokens.shape) != (1, packing.num_tokens):
        raise ValueError(
            f"packed tokens must be [1, {packing.num_tokens}], got shape {tuple(tokens.shape)}"
        )
    gpt = unwrap_model(model)
    if gpt.config.sequence_parallel:
        raise ValueError("packed sequences need megatron.sequence_parallel false")
    return model(
        input_ids=tokens,
        position_ids=packing.positions(),
        attention_mask=None,
        packed_seq_params=packing.seq_params(),
    )


def _mask_padded_vocab(gpt: GPTModel, logits: torch.Tensor) -> torch.Tensor:
    """`logits` in fp32 (the model may run in bf16), this rank's padded vocabulary columns
    set to -1e30."""
    logits = logits.float()
    start, end = _vocab_range(gpt)
    if end > hf_vocab_size(gpt):
        pad = torch.arange(start, end, device=logits.device) >= hf_vocab_size(gpt)
        logits = logits.masked_fill(pad, _PADDED_LOGIT)
    return logits


def model_logits(
    model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] (V = the HF vocab_size), gathered across TP ranks."""
    logits = local_logits(model, tokens, attention_mask)
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return full[..., : hf_vocab_size(model)]
