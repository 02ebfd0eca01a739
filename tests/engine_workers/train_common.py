"""Shared pieces of the train-engine tests: a tiny random HF Llama dir, config, batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trinity_dagster.config import TrinityConfig
from trinity_dagster.testing import config_at

VOCAB = 99  # odd: the vocabulary is padded under tensor parallelism
PROMPT = 6
RESPONSE = 5


def make_hf_dir(
    path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int = VOCAB
) -> Path:
    """A tiny random Llama (GQA, untied) saved with transformers into `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    return path


ENGINE_RUN: dict[str, Any] = {
    "model": {
        "max_prompt_tokens": PROMPT,
        "max_response_tokens": RESPONSE,
        "max_position_embeddings": 64,
    },
    "algorithm": {"repeat_times": 4, "clip_range_low": 0.2, "clip_range_high": 0.28},
    "buffer": {"train_batch_size": 8},
    "trainer": {
        "micro_batch_size": 2,
        "seed": 7,
        "total_steps": 10,
        "sft_warmup_steps": 0,  # RL from step 1; tests that need SFT steps ask for them
        "sft_lr": None,
        "optim": {"lr": 1e-2},
    },
}


def engine_config(tmp: Path, **overrides: Any) -> TrinityConfig:
    """A config for the tiny model under `tmp/run`: 8 rows in groups of 4, micro-batches of 2;
    `overrides` in dotted keys."""
    return config_at(tmp / "run", ENGINE_RUN, overrides)


def make_batch(seed: int, rows: int = 8, group: int = 4) -> dict[str, torch.Tensor]:
    """A right-padded batch like `buffer.reader.to_tensors` makes, with varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    length = PROMPT + RESPONSE
    tokens = torch.zeros(rows, length, dtype=torch.int64)
    attention = torch.zeros(rows, length, dtype=torch.bool)
    response = torch.zeros(rows, length, dtype=torch.bool)
    old = torch.zeros(rows, length, dtype=torch.float32)
    for row in range(rows):
        prompt = int(torch.randint(2, PROMPT + 1, (1,), generator=gen))
        resp = int(torch.randint(1, RESPONSE + 1, (1,), generator=gen))
        n = prompt + resp
        tokens[row, :n] = torch.randint(0, VOCAB, (n,), generator=gen)
        attention[row, :n] = True
        response[row, prompt:n] = True
        old[row, prompt:n] = -torch.rand(resp, generator=gen) * 3 - 2.5
    return {
        "tokens": tokens,
        "attention_mask": attention,
        "response_mask": response,
        "old_logprobs": old,
        "rewards": torch.rand(rows, generator=gen),
        "group_index": torch.arange(rows) // group,
        "model_version": torch.zeros(rows, dtype=torch.int64),
    }


def write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
