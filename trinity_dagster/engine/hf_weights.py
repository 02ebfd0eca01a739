"""Hugging Face (Llama/Qwen2) weights in and out of a tensor/pipeline-parallel Megatron GPTModel.

Layouts (HF -> Megatron, per TP rank r of tp):
- `embed_tokens` / `lm_head` [V, H]: rows padded with zeros to V_padded, split on dim 0.
- `q_proj`, `k_proj`, `v_proj` -> `linear_qkv`: interleaved per query group (for each group
  its q heads, then its k head, then its v head), then split on dim 0 (whole groups per
  rank). Biases the same way.
- `gate_proj`, `up_proj` -> `linear_fc1`: each split on dim 0, rank r holds
  [gate_r; up_r].
- `o_proj` -> `linear_proj`, `down_proj` -> `linear_fc2`: split on dim 1.
- norms: replicated. Tied embeddings: no `lm_head` in HF.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from safetensors import safe_open

from trinity_dagster.checkpoint.hf_dir import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, write_hf_dir
from trinity_dagster.engine.model import (
    has_qkv_bias,
    head_dim,
    hf_vocab_size,
    num_query_groups,
    tied_embeddings,
    unwrap_model,
)
from trinity_dagster.engine.value_model import SCORE_BIAS, SCORE_WEIGHT, ValueHead


class HFWeightsError(ValueError):
    """An HF weight directory does not match the model; the message names the tensor and file."""


@dataclass(frozen=True)
class _Slot:
    """One local Megatron parameter and the HF tensors it is made of."""

    param: torch.Tensor
    hf_names: tuple[str, ...]
    layout: str  # replicated | vocab | row | qkv | fc1


def _slots(model: GPTModel, hf_config: dict[str, Any]) -> Iterator[_Slot]:
    """Every parameter of this rank's model part, with its HF names and layout."""
    if model.pre_process:
        yield _Slot(model.embedding.word_embeddings.weight, ("model.embed_tokens.weight",), "vocab")
    for layer in model.decoder.layers:
        p = f"model.layers.{layer.layer_number - 1}."
        attn, mlp = layer.self_attention, layer.mlp
        yield _Slot(
            _norm_weight(layer.input_layernorm, attn.linear_qkv),
            (p + "input_layernorm.weight",),
            "replicated",
        )
        yield _Slot(
            attn.linear_qkv.weight,
            tuple(f"{p}self_attn.{n}_proj.weight" for n in "qkv"),
            "qkv",
        )
        if has_qkv_bias(hf_config):
            yield _Slot(
                attn.linear_qkv.bias, tuple(f"{p}self_attn.{n}_proj.bias" for n in "qkv"), "qkv"
            )
        yield _Slot(attn.linear_proj.weight, (p + "self_attn.o_proj.weight",), "row")
        yield _Slot(
            _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1),
            (p + "post_attention_layernorm.weight",),
            "replicated",
        )
        yield _Slot(
            mlp.linear_fc1.weight, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"
        )
        yield _Slot(mlp.linear_fc2.weight, (p + "mlp.down_proj.weight",), "row")
    if model.post_process:
        yield _Slot(model.decoder.final_layernorm.weight, ("model.norm.weight",), "replicated")
        if isinstance(model.output_layer, ValueHead):
            yield _Slot(model.output_layer.weight, (SCORE_WEIGHT,), "replicated")
            yield _Slot(model.output_layer.bias, (SCORE_BIAS,), "replicated")
        elif tied_embeddings(hf_config):
            if not model.pre_process:  # last stage's copy of the shared embedding
                yield _Slot(model.output_layer.weight, ("model.embed_tokens.weight",), "vocab")
        else:
            yield _Slot(model.output_layer.weight, ("lm_head.weight",), "vocab")


def _norm_weight(norm: torch.nn.Module, fused_linear: torch.nn.Module) -> torch.Tensor:
    """A norm's weight: its own (local spec) or the one fused into the next linear (TE spec)."""
    weight = getattr(norm, "weight", None)
    if weight is not None:
        return weight
    return cast(torch.Tensor, fused_linear.layer_norm_weight)


# ---------------------------------------------------------------- layouts


def _qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, -1, *rest),
        k.reshape(groups, -1, *rest),
        v.reshape(groups, -1, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_split(
    qkv: torch.Tensor, groups: int, heads_per_group: int, dim: int
) -> tuple[torch.Tensor, ...]:
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (heads_per_group + 2) * dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * dim, dim, dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _local_shard(
    slot: _Slot, hf: list[torch.Tensor], hf_config: dict[str, Any], tp: int, rank: int
) -> torch.Tensor:
    """This TP rank's shard of a Megatron parameter, from its full HF tensors."""
    if slot.layout == "replicated":
        return hf[0]
    if slot.layout == "vocab":
        full = hf[0]
        padded = slot.param.shape[0] * tp
        if padded > full.shape[0]:
            pad = full.new_zeros(padded - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad])
        return full.chunk(tp)[rank]
    if slot.layout == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    if slot.layout == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if slot.layout == "qkv":
        q, k, v = hf
        return _qkv_interleave(q, k, v, num_query_groups(hf_config)).chunk(tp)[rank]
    raise AssertionError(f"unknown layout {slot.layout}")


def _full_hf(
    slot: _Slot, shards: list[torch.Tensor], hf_config: dict[str, Any], vocab: int
) -> list[torch.Tensor]:
    """The full HF tensors of a Megatron parameter, from its TP shards in rank order."""
    if slot.layout == "replicated":
        return [shards[0]]
    if slot.layout == "vocab":
        return [torch.cat(shards)[:vocab]]
    if slot.layout == "row":
        return [torch.cat(shards, dim=1)]
    if slot.layout == "fc1":
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if slot.layout == "qkv":
        groups = num_query_groups(hf_config)
        heads_per_group = hf_config["num_attention_heads"] // groups
        return list(_qkv_split(torch.cat(shards), groups, heads_per_group, head_dim(hf_config)))
    raise AssertionError(f"unknown layout {slot.layout}")


# ---------------------------------------------------------------- import


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file that holds it."""
    index = hf_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise HFWeightsError(f"{index}: not a safetensors index ({err})") from None
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / WEIGHTS_FILE
    if not single.is_file():
        raise HFWeightsError(f"{hf_dir}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} exists")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class _TensorReader:
    """Reads named tensors from safetensors files, keeping each file open once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise HFWeightsError(f"tensor {name!r} is missing from the HF weights")
        path = self.files[name]
        if path not in self._open:
            if not path.is_file():
                raise HFWeightsError(f"{path}: weight file listed in the index does not exist")
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name)


def load_hf_into_model(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Load this rank's shards of the HF weights in `hf_dir` into `model` (copied in place).

    A value model (`ValueHead`) loads its head from `score.*` when the directory has it (a
    token-classification model) and keeps its own otherwise (a causal LM, whose `lm_head`
    it does not use). Raises HFWeightsError naming the tensor and file on a missing,
    unexpected or misshaped tensor.
    """
    hf_dir = Path(hf_dir)
    gpt = unwrap_model(model)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    files = _weight_files(hf_dir)
    reader = _TensorReader(files)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    used: set[str] = set()
    value_model = gpt.post_process and isinstance(gpt.output_layer, ValueHead)
    slots = list(_slots(gpt, hf_config))
    if value_model and SCORE_WEIGHT not in files:
        slots = [slot for slot in slots if slot.hf_names[0] not in (SCORE_WEIGHT, SCORE_BIAS)]
    with torch.no_grad():
        for slot in slots:
            hf = [reader.get(name) for name in slot.hf_names]
            _check_hf_shapes(slot, hf, hf_config, files)
            shard = _local_shard(slot, hf, hf_config, tp, rank)
            if shard.shape != slot.param.shape:
                raise HFWeightsError(
                    f"{', '.join(slot.hf_names)} in {files[slot.hf_names[0]]}: TP rank {rank} "
                    f"shard has shape {tuple(shard.shape)}, model expects "
                    f"{tuple(slot.param.shape)}"
                )
            slot.param.copy_(shard)
            used.update(slot.hf_names)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        ignorable = {"lm_head.weight"} if tied_embeddings(hf_config) or value_model else set()
        unexpected = sorted(set(files) - used - ignorable)
        if unexpected:
            raise HFWeightsError(
                f"{hf_dir}: tensors not used by the model: {', '.join(unexpected[:10])}"
                + (" ..." if len(unexpected) > 10 else "")
            )


def _check_hf_shapes(
    slot: _Slot, hf: list[torch.Tensor], hf_config: dict[str, Any], files: dict[str, Path]
) -> None:
    hidden = hf_config["hidden_size"]
    expected: list[tuple[int, ...]]
    if slot.layout == "vocab":
        expected = [(hf_config["vocab_size"], hidden)]
    elif slot.layout == "qkv":
        groups, dim = num_query_groups(hf_config), head_dim(hf_config)
        q_rows, kv_rows = hf_config["num_attention_heads"] * dim, groups * dim
        tail = (hidden,) if slot.hf_names[0].endswith("weight") else ()
        expected = [(q_rows, *tail), (kv_rows, *tail), (kv_rows, *tail)]
    else:
        return
    for name, tensor, shape in zip(slot.hf_names, hf, expected, strict=True):
        if tuple(tensor.shape) != shape:
            raise HFWeightsError(
                f"{name} in {files[name]}: shape {tuple(tensor.shape)}, config.json implies {shape}"
            )


# ---------------------------------------------------------------- export


def _gather_tp(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """Copies of all TP shards of `tensor` on TP rank 0 (rank order); None on other TP ranks."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [tensor.detach().to("cpu", copy=True)]
    group = parallel_state.get_tensor_model_parallel_group()
    dst = parallel_state.get_tensor_model_parallel_src_rank()
    local = tensor.detach().contiguous()
    is_dst = parallel_state.get_tensor_model_parallel_rank() == 0
    shards = [torch.empty_like(local) for _ in range(tp)] if is_dst else None
    dist.gather(local, shards, dst=dst, group=group)
    return shards


def hf_state_dict_from_model(model: torch.nn.Module, hf_config: dict[str, Any]) -> dict[str, Any]:
    """Full HF-named tensors on global rank 0; an empty dict on every other rank.

    The tensors are CPU copies, unaffected by later training. Collective: every rank of the
    model must call it.
    """
    gpt = unwrap_model(model)
    vocab = hf_vocab_size(gpt)
    if parallel_state.get_data_parallel_rank() != 0:
        return {}
    is_tp0 = parallel_state.get_tensor_model_parallel_rank() == 0
    stage: dict[str, torch.Tensor] = {}
    for slot in _slots(gpt, hf_config):
        shards = _gather_tp(slot.param)
        if is_tp0 and shards is not None:
            full = _full_hf(slot, [s.cpu() for s in shards], hf_config, vocab)
            stage.update(zip(slot.hf_names, full, strict=True))
    if not is_tp0:
        return {}
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        first = parallel_state.get_pipeline_model_parallel_first_rank()
        is_first = parallel_state.is_pipeline_first_stage()
        stages: list[Any] | None = [None] * pp if is_first else None
        dist.gather_object(stage, stages, dst=first, group=group)
        if not is_first or stages is None:
            return {}
        stage = {k: v for part in stages for k, v in part.items()}
    return {name: t.contiguous() for name, t in stage.items()}


def export_model_to_hf(
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    out_dir: str | Path,
    tokenizer_src: Path | None = None,
) -> Path | None:
    """Write an HF directory of the model on global rank 0; returns it there, None elsewhere.

    The directory is `checkpoint.hf_dir`'s format: weights, config, and the tokenizer files and
    generation config of `tokenizer_src`. Collective.
    """
    state = hf_state_dict_from_model(model, hf_config)
    out: Path | None = None
    if _global_rank() == 0:
        out = write_hf_dir(Path(out_dir), state, hf_config, tokenizer_src)
    if dist.is_initialized():
        dist.barrier()
    return out


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
