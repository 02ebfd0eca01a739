"""PPO's value model: a Megatron GPTModel whose output layer is a scalar value head.

The head is Hugging Face's token-classification `score` layer with one label (a Linear from
the hidden size to 1, with bias), as verl's critic: `weight` [1, H] and `bias` [1], the
same on every tensor-parallel rank. Its value at position t is read from the hidden state at
t-1, so `values[:, t]` estimates the state just before token t, aligned like the log-probs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.model import (
    build_gpt_model,
    packed_forward,
    padded_forward,
    unwrap_model,
)
from trinity_dagster.engine.packing import Packing

# HF names of the value head, as transformers' *ForTokenClassification saves it.
SCORE_WEIGHT = "score.weight"
SCORE_BIAS = "score.bias"
_TOKEN_CLASSIFICATION = {
    "llama": "LlamaForTokenClassification",
    "qwen2": "Qwen2ForTokenClassification",
}


class ValueHead(torch.nn.Module):
    """Hidden states [s, b, H] -> values [s, b, 1], in GPTModel's output-layer call form."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def reset(self, std: float, seed: int) -> None:
        """Draw the weight from N(0, std^2) with its own seed (equal on every rank); bias 0."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            fresh = torch.randn(self.weight.shape, generator=generator, dtype=torch.float64)
            self.weight.copy_(fresh * std)
            self.bias.zero_()

    def forward(
        self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[Tensor, None]:
        """(values [s, b, 1], no bias): `weight` and `runtime_gather_output` are GPTModel's
        arguments for a vocabulary layer and are not used."""
        return F.linear(hidden, self.weight, self.bias), None


def build_value_model(
    hf_config: dict[str, Any],
    megatron_cfg: MegatronConfig,
    *,
    params_dtype: torch.dtype | str,
    head_seed: int,
) -> GPTModel:
    """This rank's value model for `hf_config`: the GPT backbone and a fresh `ValueHead`."""
    untied = {**hf_config, "tie_word_embeddings": False}  # no output weight to share
    model = build_gpt_model(untied, megatron_cfg, params_dtype=params_dtype)
    if not model.post_process:
        raise ValueError("the value model needs pipeline_model_parallel_size 1")
    device = model.embedding.word_embeddings.weight.device
    head = ValueHead(hf_config["hidden_size"], model.config.params_dtype).to(device)
    head.reset(std=hf_config.get("initializer_range", 0.02), seed=head_seed)
    model.output_layer = head
    return model


def is_value_model(model: torch.nn.Module) -> bool:
    """Whether `model` (or the GPTModel it wraps) ends in a `ValueHead`."""
    gpt = unwrap_model(model)
    return gpt.post_process and isinstance(gpt.output_layer, ValueHead)


def token_values(
    model: torch.nn.Module, micro_batch: dict[str, Tensor], packing: Packing | None
) -> Tensor:
    """Values [b, T] of the micro-batch's rows in fp32, aligned at the token each precedes
    (position 0 holds 0); `packing` as the actor's forward uses it, or None for padded rows."""
    tokens = micro_batch["tokens"]
    if packing is None:
        out = padded_forward(model, tokens, micro_batch["attention_mask"])
    else:
        out = packed_forward(model, packing.pack(tokens), packing)
    shifted = F.pad(out[..., 0].float()[:, :-1], (1, 0))
    return shifted if packing is None else packing.unpack(shifted)


def token_classification_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The HF config of an exported value model: *ForTokenClassification with one label."""
    config = {
        key: value
        for key, value in hf_config.items()
        if key not in ("id2label", "label2id", "num_labels")
    }
    config["architectures"] = [_TOKEN_CLASSIFICATION[hf_config["model_type"]]]
    config["id2label"] = {"0": "LABEL_0"}
    config["label2id"] = {"LABEL_0": 0}
    config["tie_word_embeddings"] = False
    return config
