"""Batched autoregressive generation with a KV cache, recording each token's log-prob.

Prompts of different lengths are left-padded, with position ids counted from each prompt's
first real token, so every row sees exactly what it would see alone. The recorded log-prob of
a generated token is `log_softmax(logits / temperature)[token]`, before any top-p truncation:
exactly what the trainer recomputes from the same weights (`engine.train_step`
`token_logprobs_and_entropy` divides the logits by `explorer.temperature`), so the importance
ratio of a fresh batch is 1. At temperature 1 it is the log_softmax of the raw logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Generation:
    """One generated response: its token ids, their log-probs, and whether it hit `<eos>`."""

    response_ids: list[int]
    logprobs: list[float]
    finished: bool


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen: greedy, or sampled with temperature and top-p.

    `temperature` also scales the logits the recorded log-probs come from.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _cache_name(model: PreTrainedModel) -> str:
    """The forward argument (and output field) of the KV cache: `cache` since transformers 5.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def choose_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token from temperature-scaled `logits`: argmax, or a top-p sample."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> list[Generation]:
    """Generate one response per prompt, stopping a row at `<eos>` or `max_new_tokens`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no prompt may be empty")
    batch, width = len(prompts), max(len(p) for p in prompts)
    device = model.device
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros((batch, width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention[row, width - len(prompt) :] = 1
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    cache_name = _cache_name(model)
    out = model(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True
    )
    logits, cache = out.logits[:, -1, :], getattr(out, cache_name)
    next_position = positions[:, -1:] + 1
    responses: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    unfinished = list(range(batch))  # rows without `<eos>` yet, as `~done` (no tensor reads)
    for step in range(params.max_new_tokens):
        logits = logits.float() / params.temperature
        token = choose_next_tokens(logits, params, generator)
        token_logprob = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        tokens, token_logprobs = token.tolist(), token_logprob.tolist()
        for row in unfinished:
            responses[row].append(tokens[row])
            logprobs[row].append(token_logprobs[row])
        unfinished = [row for row in unfinished if tokens[row] != eos_token_id]
        done |= token == eos_token_id
        if not unfinished or step == params.max_new_tokens - 1:
            break
        token = token.masked_fill(done, pad_token_id)
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=next_position,
            use_cache=True,
            **{cache_name: cache},
        )
        logits, cache = out.logits[:, -1, :], getattr(out, cache_name)
        next_position = next_position + 1
    return [
        Generation(ids, lps, bool(ids and ids[-1] == eos_token_id))
        for ids, lps in zip(responses, logprobs, strict=True)
    ]
