"""Random models and GRPO batches for the benchmarks (no downloads, fixed seeds)."""

from pathlib import Path

import torch


def make_llama_dir(
    path: Path, *, vocab: int, hidden: int, ffn: int, layers: int, heads: int, seq: int
) -> None:
    """A random Llama (grouped-query: heads // 2 key/value heads), saved with transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2 * seq,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)


def grpo_batch(
    gen: torch.Generator, *, rows: int, seq: int, vocab: int, group: int = 4
) -> dict[str, torch.Tensor]:
    """Full-length rows, half prompt and half response, GRPO groups of `group` rows, with
    plausible old log-probs: the tensors `buffer.reader.to_tensors` gives the engine."""
    response = torch.zeros(rows, seq, dtype=torch.bool)
    response[:, seq // 2 :] = True
    old = torch.where(response, -torch.rand(rows, seq, generator=gen) - 8.5, torch.zeros(()))
    return {
        "tokens": torch.randint(0, vocab, (rows, seq), generator=gen),
        "attention_mask": torch.ones(rows, seq, dtype=torch.bool),
        "response_mask": response,
        "old_logprobs": old,
        "rewards": torch.rand(rows, generator=gen),
        "group_index": torch.arange(rows) // group,
    }


def rollout_lengths(
    gen: torch.Generator, *, rows: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt lengths, response lengths) [rows] spread like RL rollouts in `seq` positions.

    Prompts take 1/8 to 1/4 of `seq`; a response is exponential with a mean of 0.45 of the
    room its prompt leaves, cut at that room (about one in nine truncated, at full length).
    """
    prompt = torch.randint(seq // 8, seq // 4 + 1, (rows,), generator=gen)
    room = seq - prompt
    draw = torch.empty(rows).exponential_(1 / 0.45, generator=gen)
    response = torch.minimum((draw * room).ceil().long().clamp(min=1), room)
    return prompt, response


def varied_grpo_batch(
    gen: torch.Generator, *, rows: int, seq: int, vocab: int, group: int = 4
) -> dict[str, torch.Tensor]:
    """`grpo_batch` with rows of `rollout_lengths`, right-padded to `seq`."""
    batch = grpo_batch(gen, rows=rows, seq=seq, vocab=vocab, group=group)
    prompt, response = rollout_lengths(gen, rows=rows, seq=seq)
    position = torch.arange(seq)
    attention = position < (prompt + response)[:, None]
    in_response = attention & (position >= prompt[:, None])
    old = -torch.rand(rows, seq, generator=gen) - 8.5
    batch.update(
        tokens=batch["tokens"] * attention,
        attention_mask=attention,
        response_mask=in_response,
        old_logprobs=torch.where(in_response, old, torch.zeros(())),
    )
    return batch
