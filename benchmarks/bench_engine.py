"""Tokens/s of a GRPO train step: the Megatron-core TrainEngine vs a plain PyTorch loop.

The baseline is transformers' LlamaForCausalLM (default attention) with torch AdamW and the
same loss math (GRPO advantages, PPO-clip, token-mean, entropy as a metric, grad clipping),
on the same random model, sizes and batches. Both run in this process, alternating step by
step after warm-up; each side's fastest measured step counts (the machine is shared). The
last line printed is one JSON object with the figures: the benchmark size; under `small`
(ratio also as `small_ratio`) a small model of the demo's width and depth at batch 64,
micro-batch 8, where fixed costs per call weigh most; under `packed`
(ratio also as `packed_ratio`) the benchmark size with rollout-like row lengths (about half
the positions real), the engine packing its micro-batches against the plain loop padding
each micro-batch to its longest row, in real (effective) tokens/s; under `ppo` (ratio also
as `ppo_ratio`) a PPO step at the benchmark size, actor and critic: the engine's value model
and GAE against transformers' LlamaForTokenClassification (one label) as the plain loop's
critic, each with its own AdamW, the same GAE, clipped value loss and PPO-clip loss.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.synthetic import grpo_batch, make_llama_dir, varied_grpo_batch


def build_engine(hf_dir: Path, args: argparse.Namespace):
    """A TrainEngine on the benchmark model (single process), packing when `args.varied`."""
    from trinity_dagster.config import config_from_dict
    from trinity_dagster.engine.engine import TrainEngine

    config = config_from_dict(
        {
            "run_root": str(hf_dir.parent / "run"),
            "model": {
                "max_prompt_tokens": args.seq // 2,
                "max_response_tokens": args.seq // 2,
                "max_position_embeddings": 2 * args.seq,
            },
            "algorithm": {"repeat_times": 4, **ALGORITHM[args.algorithm]},
            "buffer": {"train_batch_size": args.batch},
            "trainer": {
                "micro_batch_size": args.micro_batch,
                "sequence_packing": args.varied,
                "total_steps": args.warmup + args.steps,
                "sft_warmup_steps": 0,  # RL steps from the first (the default has SFT steps)
                "optim": {"lr": 1e-5},
            },
        }
    )
    return TrainEngine(config, hf_dir)


# The engine's algorithm settings per case; the plain loops below do the same math.
ALGORITHM = {
    "grpo": {},
    "ppo": {"algorithm_type": "ppo", "kl_loss_fn": "none", "clip_range_high": 0.28},
}


def pieces(batch: dict[str, torch.Tensor], micro_batch: int):
    """The batch's micro-batches, each cut to its longest row, with their first row index."""
    for start in range(0, batch["tokens"].shape[0], micro_batch):
        part = {k: v[start : start + micro_batch] for k, v in batch.items()}
        longest = int(part["attention_mask"].sum(dim=1).max())
        yield start, {k: v[:, :longest] if v.dim() == 2 else v for k, v in part.items()}


def torch_ppo_step(models, optimizers, batch: dict[str, torch.Tensor], micro_batch: int) -> float:
    """One PPO step of the plain loop: critic values, GAE, a critic update on the clipped value
    loss, then the actor's PPO-clip update, micro-batched like the engine; the entropy."""
    from trinity_dagster.algorithms import token_level_rewards
    from trinity_dagster.algorithms.value import gae_advantages_and_returns

    actor, critic = models
    actor_opt, critic_opt = optimizers
    mask = batch["response_mask"]
    values = torch.zeros(mask.shape)
    with torch.no_grad():
        for start, part in pieces(batch, micro_batch):
            out = critic(input_ids=part["tokens"], attention_mask=part["attention_mask"].long())
            v = torch.nn.functional.pad(out.logits[:, :-1, 0], (1, 0))
            values[start : start + v.shape[0], : v.shape[1]] = v
    rewards = token_level_rewards(batch["rewards"].float(), mask)
    advantages, returns = gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    num_tokens = mask.sum()
    critic_opt.zero_grad()
    for start, part in pieces(batch, micro_batch):
        rows, length = part["tokens"].shape
        old = values[start : start + rows, :length]
        target = returns[start : start + rows, :length]
        out = critic(input_ids=part["tokens"], attention_mask=part["attention_mask"].long())
        vpred = torch.nn.functional.pad(out.logits[:, :-1, 0], (1, 0))
        clipped = torch.maximum(torch.minimum(vpred, old + 0.5), old - 0.5)
        loss = torch.maximum((vpred - target) ** 2, (clipped - target) ** 2)
        (0.5 * loss[part["response_mask"]].sum() / num_tokens).backward()
    torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
    critic_opt.step()
    actor_opt.zero_grad()
    entropy = 0.0
    for start, part in pieces(batch, micro_batch):
        tokens, part_mask = part["tokens"], part["response_mask"]
        logits = actor(input_ids=tokens, attention_mask=part["attention_mask"].long()).logits
        logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = torch.nn.functional.pad(logp_all.gather(-1, tokens[:, 1:, None])[..., 0], (1, 0))
        with torch.no_grad():  # a metric, as the engine's
            entropy += float((-(logp_all.exp() * logp_all).sum(-1))[part_mask[:, 1:]].sum())
        adv = advantages[start : start + tokens.shape[0], : tokens.shape[1]]
        ratio = torch.exp((logp - part["old_logprobs"]).clamp(-20, 20))
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -3.0 * adv), surrogate)
        (surrogate[part_mask].sum() / num_tokens).backward()
    torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
    actor_opt.step()
    return entropy / float(num_tokens)


def torch_step(model, optimizer, batch: dict[str, torch.Tensor], micro_batch: int) -> float:
    """One GRPO step of the plain loop (same advantages, PPO-clip loss, clipping); entropy.

    Each micro-batch is padded to its longest row, as a collator with `padding="longest"`.
    """
    rewards, groups = batch["rewards"].double(), batch["group_index"]
    adv_seq = torch.empty_like(rewards)
    for g in groups.unique():
        rows = groups == g
        adv_seq[rows] = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + 1e-6)
    num_tokens = batch["response_mask"].sum()
    entropy = 0.0
    optimizer.zero_grad()
    for start in range(0, batch["tokens"].shape[0], micro_batch):
        part = {k: v[start : start + micro_batch] for k, v in batch.items()}
        longest = int(part["attention_mask"].sum(dim=1).max())
        part = {k: v[:, :longest] if v.dim() == 2 else v for k, v in part.items()}
        tokens, mask = part["tokens"], part["response_mask"]
        logits = model(input_ids=tokens, attention_mask=part["attention_mask"].long()).logits
        logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = torch.nn.functional.pad(logp_all.gather(-1, tokens[:, 1:, None])[..., 0], (1, 0))
        with torch.no_grad():
            entropy += float((-(logp_all.exp() * logp_all).sum(-1))[mask[:, 1:]].sum())
        adv = adv_seq[start : start + micro_batch, None].float().expand_as(logp)
        ratio = torch.exp((logp - part["old_logprobs"]).clamp(-20, 20))
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        (surrogate[mask].sum() / num_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return entropy / float(num_tokens)


def timed(fn) -> float:
    """Wall seconds of `fn()`."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# A small model of the demo's width and depth (hidden 128, 2 layers, 4 heads / 2 KV groups,
# ffn 352, prompt 24 + response 8 tokens, 81 ids), batch 64, micro-batch 8: a step of many
# small calls, where fixed costs per call weigh most.
SMALL_CASE = {
    "hidden": 128,
    "ffn": 352,
    "layers": 2,
    "heads": 4,
    "vocab": 81,
    "seq": 32,
    "batch": 64,
    "micro_batch": 8,
}


def run_case(tmp: Path, args: argparse.Namespace) -> dict:
    """Engine and plain loop on one model size, alternating steps; each side's fastest step.

    With `args.varied`, rows have rollout-like lengths (`varied_grpo_batch`), the engine packs
    them (`trainer.sequence_packing`) and the figures count real tokens only.
    """
    make_batch = varied_grpo_batch if args.varied else grpo_batch
    engine_times: list[float] = []
    torch_times: list[float] = []
    tokens: list[int] = []
    hf_dir = tmp / "hf"
    make_llama_dir(
        hf_dir,
        vocab=args.vocab,
        hidden=args.hidden,
        ffn=args.ffn,
        layers=args.layers,
        heads=args.heads,
        seq=args.seq,
    )
    from transformers import LlamaForCausalLM, LlamaForTokenClassification

    model = LlamaForCausalLM.from_pretrained(hf_dir).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    plain_step = partial(torch_step, model, optimizer)
    if args.algorithm == "ppo":
        critic = LlamaForTokenClassification.from_pretrained(hf_dir, num_labels=1).float().train()
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-5, weight_decay=0.0)
        plain_step = partial(torch_ppo_step, (model, critic), (optimizer, critic_opt))
    engine = build_engine(hf_dir, args)
    try:
        # Alternate the two so that load from other processes hits both alike.
        for step in range(1, args.warmup + args.steps + 1):
            batch = make_batch(
                torch.Generator().manual_seed(step),
                rows=args.batch,
                seq=args.seq,
                vocab=args.vocab,
            )
            engine_s = timed(lambda b=batch, n=step: engine.train_step(n, b))
            torch_s = timed(lambda b=batch: plain_step(b, args.micro_batch))
            if step > args.warmup:
                engine_times.append(engine_s)
                torch_times.append(torch_s)
                tokens.append(int(batch["attention_mask"].sum()))
    finally:
        engine.close()
    engine_rate = max(n / t for n, t in zip(tokens, engine_times, strict=True))
    torch_rate = max(n / t for n, t in zip(tokens, torch_times, strict=True))
    return {
        "engine_tokens_per_s": round(engine_rate, 1),
        "torch_tokens_per_s": round(torch_rate, 1),
        "ratio": round(engine_rate / torch_rate, 3),
        "engine_step_s": round(min(engine_times), 3),
        "torch_step_s": round(min(torch_times), 3),
        "real_token_fraction": round(sum(tokens) / (len(tokens) * args.batch * args.seq), 3),
        "sequence_packing": args.varied,
        "algorithm": args.algorithm,
        "hidden": args.hidden,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "vocab": args.vocab,
        "measured_steps": args.steps,
        "engine_step_s_all": [round(t, 3) for t in engine_times],
        "torch_step_s_all": [round(t, 3) for t in torch_times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--small-steps", type=int, default=10, help="measured steps, small case")
    parser.add_argument("--packed-batch", type=int, default=32, help="rows, packed case")
    args = parser.parse_args()
    args.varied = False
    args.algorithm = "grpo"
    small_args = argparse.Namespace(
        **{**vars(args), **SMALL_CASE, "warmup": 2, "steps": args.small_steps}
    )
    packed_args = argparse.Namespace(**{**vars(args), "batch": args.packed_batch, "varied": True})
    ppo_args = argparse.Namespace(**{**vars(args), "algorithm": "ppo"})
    # Megatron's parallel state is global per process: one engine at a time, closed in between.
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        result = run_case(Path(tmp), args)
    with tempfile.TemporaryDirectory(prefix="bench-engine-small-") as tmp:
        small = run_case(Path(tmp), small_args)
    with tempfile.TemporaryDirectory(prefix="bench-engine-packed-") as tmp:
        packed = run_case(Path(tmp), packed_args)
    result["small"] = small
    result["small_ratio"] = small["ratio"]
    with tempfile.TemporaryDirectory(prefix="bench-engine-ppo-") as tmp:
        ppo = run_case(Path(tmp), ppo_args)
    result["packed"] = packed
    result["packed_ratio"] = packed["ratio"]
    result["ppo"] = ppo
    result["ppo_ratio"] = ppo["ratio"]
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
