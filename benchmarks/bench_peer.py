"""Our GRPO loop against a plain single-process one, at 256 and 64 rows a step.

Both start from the same SFT model and draw the same tasks (the demo's task set, its seed,
the explorer's per-step draw), with the demo's sampling (temperature 1.0, top_p 0.5, up to
8 response tokens), GRPO group size 8, learning rate, clipping and micro-batch size.
- **ours**: `run_training` (what `trinity-dagster run` does) through the real daemon, the
  built-in explorer and the engine service, weights synced every step, at
  `synchronizer.sync_offset` 1 (generation of step N+1 beside the training of step N) and 0,
  without `bench step`'s memory sampler (its CPU would count against ours alone).
- **plain**: one Python process, written here: transformers' `generate` (sampling, the
  token log-probs from its logits), the reward function, GRPO advantages, and the PPO-clip
  token-mean loss from `trinity_dagster.algorithms` on a transformers model with torch AdamW
  and gradient clipping; strictly one step after another, nothing written to disk.
The SFT model is made first with the plain loop: `--sft-steps` steps (the demo's warm-up) of
the demonstrations' negative log-likelihood at `trainer.sft_lr`, from the demo's weights
version 0. Each run is its own process; a run's s/step is the median wall of steps 5 to
`--steps`. With `--repeats R` each row count runs R rounds of plain, ours at offset 1 and ours
at offset 0, one after another, and a round's ratio divides its ours by its plain (so that both
see the machine as it was then). Printed last, as JSON: `ratio_<rows>_offset<k>` = ours /
plain s/step, the median over the rounds (goals: <= 1.0 at 256 rows and <= 1.5 at 64 with
offset 1; <= 1.3 and <= 2.0 with offset 0), `ratios_<rows>_offset<k>` each round's, and every
run's figures (a list per kind, by round). Run from the repository root (the daemon loads
`workspace.yaml` there).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.bench_daemon import run_isolated
from trinity_dagster.config import TrinityConfig, load_config

MODULE = "benchmarks.bench_peer"
ROW_COUNTS = (256, 64)
OFFSETS = (1, 0)
FIRST_TIMED_STEP = 5
GOALS = {
    "ratio_256_offset1": 1.0,
    "ratio_64_offset1": 1.5,
    "ratio_256_offset0": 1.3,
    "ratio_64_offset0": 2.0,
}


def sized_overrides(rows: int) -> dict[str, object]:
    """Config overrides for `rows` rows a step: tasks, batch and micro-batch to match."""
    config = load_config(None)
    micro = min(config.trainer.micro_batch_size, rows)
    return {
        "explorer.tasks_per_step": rows // config.algorithm.repeat_times,
        "buffer.train_batch_size": rows,
        "trainer.micro_batch_size": micro,
    }


def _optimizer(model: Any, config: TrinityConfig, lr: float) -> Any:
    import torch

    optim = config.trainer.optim
    return torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
    )


def layout(prompts: list[list[int]], responses: list[list[int]], pad: int) -> dict[str, Any]:
    """Rows as [left-padded prompt | right-padded response]: ids, attention, positions, and
    the response mask, all [B, L]."""
    import torch

    width = max(len(p) for p in prompts)
    length = max(len(r) for r in responses)
    ids = torch.full((len(prompts), width + length), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        ids[row, width : width + len(response)] = torch.tensor(response)
        attention[row, width - len(prompt) : width + len(response)] = 1
        mask[row, width : width + len(response)] = True
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    return {"ids": ids, "attention": attention, "positions": positions, "mask": mask}


def train_on(
    model: Any,
    optimizer: Any,
    rows: dict[str, Any],
    config: TrinityConfig,
    loss_name: str,
) -> float:
    """One optimizer step over `rows` (from `layout`, plus `old_logprobs` and `advantages`
    [B, L]) in micro-batches, the loss `loss_name`; returns the mean response entropy."""
    import torch

    from trinity_dagster.algorithms import policy_loss

    algorithm, temperature = config.algorithm, config.explorer.temperature
    num_tokens = float(rows["mask"].sum())
    micro = config.trainer.micro_batch_size
    entropy = 0.0
    optimizer.zero_grad()
    for start in range(0, rows["ids"].shape[0], micro):
        part = {key: value[start : start + micro] for key, value in rows.items()}
        logits = model(
            input_ids=part["ids"],
            attention_mask=part["attention"],
            position_ids=part["positions"],
        ).logits[:, :-1]
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logp_all.gather(-1, part["ids"][:, 1:, None])[..., 0]
        logp = torch.nn.functional.pad(logp, (1, 0))
        with torch.no_grad():
            per_token = -(logp_all.exp() * logp_all).sum(-1)
            entropy += float(per_token[part["mask"][:, 1:]].sum())
        loss, _ = policy_loss(
            loss_name,
            logp,
            part["old_logprobs"],
            part["advantages"],
            part["mask"],
            clip_range_low=algorithm.clip_range_low,
            clip_range_high=algorithm.clip_range_high,
            dual_clip=algorithm.dual_clip,
            loss_agg_mode=algorithm.loss_agg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=float(rows["ids"].shape[0]),
            max_response_len=config.model.max_response_tokens,
        )
        loss.backward()
    if config.trainer.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.trainer.optim.grad_clip)
    optimizer.step()
    return entropy / num_tokens


def make_sft_model(root: Path, sft_steps: int) -> dict[str, Any]:
    """The demo's weights version 0 after `sft_steps` plain SFT steps, saved at root/sft."""
    import torch
    from transformers import AutoModelForCausalLM

    from trinity_dagster.checkpoint.initial_weights import create_initial_model
    from trinity_dagster.explorer.demonstrations import demonstration_rows
    from trinity_dagster.paths import RunPaths
    from trinity_dagster.tokenizer import load_tokenizer

    config = load_config(None, overrides={"run_root": str(root / "init")})
    initial = create_initial_model(config, RunPaths.of_config(config))
    tokenizer = load_tokenizer(initial)
    torch.manual_seed(config.trainer.seed)
    model = AutoModelForCausalLM.from_pretrained(str(initial), dtype=torch.float32).train()
    optimizer = _optimizer(model, config, config.trainer.sft_lr or config.trainer.optim.lr)
    started = time.perf_counter()
    for step in range(1, sft_steps + 1):
        demos = demonstration_rows(config, config.buffer.train_batch_size, seed=step)
        rows = layout(
            [d["tokens"][: d["prompt_length"]] for d in demos],
            [d["tokens"][d["prompt_length"] :] for d in demos],
            tokenizer.pad_token_id,
        )
        rows["old_logprobs"] = torch.zeros(rows["ids"].shape)
        rows["advantages"] = torch.zeros(rows["ids"].shape)
        train_on(model, optimizer, rows, config, "sft")
    out = root / "sft"
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return {"sft_steps": sft_steps, "sft_s": round(time.perf_counter() - started, 2)}


class PlainLoop:
    """The single-process GRPO loop: generate, score, advantages, one optimizer step."""

    def __init__(self, model_dir: Path, rows: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from trinity_dagster.explorer.rewards import get_reward_fn
        from trinity_dagster.tasks import load_taskset
        from trinity_dagster.tokenizer import load_tokenizer

        self.config = load_config(
            None, overrides={"model.path": str(model_dir), **sized_overrides(rows)}
        )
        self.taskset = load_taskset(self.config.explorer.taskset, self.config.explorer.seed)
        self.reward_fn = get_reward_fn(self.config.explorer.reward_fn)
        self.tokenizer = load_tokenizer(model_dir)
        torch.manual_seed(self.config.trainer.seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.optimizer = _optimizer(self.model, self.config, self.config.trainer.optim.lr)

    def tasks(self, step: int) -> list[Any]:
        """The built-in explorer's tasks of `step`: the same seed-and-step draw."""
        from trinity_dagster.explorer.explorer import derive_seed

        rng = random.Random(derive_seed("tasks", self.config.explorer.seed, step))
        return self.taskset.sample(self.config.explorer.tasks_per_step, rng)

    def generate(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Sampled responses (cut after `<eos>`) and their tokens' log-probs at temperature."""
        import torch

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        explorer = self.config.explorer
        batch = layout(prompts, [[]] * len(prompts), pad)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=batch["ids"],
                attention_mask=batch["attention"],
                do_sample=True,
                temperature=explorer.temperature,
                top_p=explorer.top_p,
                top_k=0,
                max_new_tokens=self.config.model.max_response_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
        generated = out.sequences[:, batch["ids"].shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / explorer.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, generated[..., None])[..., 0]
        responses, response_logprobs = [], []
        for ids, lps in zip(generated.tolist(), logprobs.tolist(), strict=True):
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            responses.append(ids[:end])
            response_logprobs.append(lps[:end])
        return responses, response_logprobs

    def step(self, step: int) -> dict[str, float]:
        """One GRPO step; its wall time split into generation (and scoring) and training."""
        import torch

        from trinity_dagster.algorithms import compute_advantages
        from trinity_dagster.tokenizer import decode_response, encode_prompt

        started = time.perf_counter()
        repeat = self.config.algorithm.repeat_times
        tasks = [task for task in self.tasks(step) for _ in range(repeat)]
        prompts = [encode_prompt(self.tokenizer, task.prompt, task.task_id) for task in tasks]
        responses, logprobs = self.generate(prompts)
        rewards = [
            self.reward_fn(decode_response(self.tokenizer, ids), task.answer)
            for ids, task in zip(responses, tasks, strict=True)
        ]
        generated = time.perf_counter()
        rows = layout(prompts, responses, self.tokenizer.pad_token_id)
        width = rows["ids"].shape[1] - max(len(r) for r in responses)
        old = torch.zeros(rows["ids"].shape)
        for row, lps in enumerate(logprobs):
            old[row, width : width + len(lps)] = torch.tensor(lps)
        rows["old_logprobs"] = old
        rows["advantages"] = compute_advantages(
            self.config.algorithm.advantage_fn,
            torch.tensor(rewards),
            torch.arange(len(tasks)) // repeat,
            rows["mask"],
            epsilon=self.config.algorithm.advantage_epsilon,
        )
        self.model.train()
        loss_name = self.config.algorithm.policy_loss_fn
        train_on(self.model, self.optimizer, rows, self.config, loss_name)
        ended = time.perf_counter()
        return {
            "step_s": ended - started,
            "generate_s": generated - started,
            "train_s": ended - generated,
            "reward": sum(rewards) / len(rewards),
        }


def run_plain(model_dir: Path, rows: int, steps: int) -> dict[str, Any]:
    """`steps` steps of the plain loop; medians over steps FIRST_TIMED_STEP..`steps`."""
    loop = PlainLoop(model_dir, rows)
    done = [loop.step(step) for step in range(1, steps + 1)]
    timed = done[FIRST_TIMED_STEP - 1 :]
    return {
        "rows": rows,
        "step_s": round(median(d["step_s"] for d in timed), 4),
        "generate_s": round(median(d["generate_s"] for d in timed), 4),
        "train_s": round(median(d["train_s"] for d in timed), 4),
        "mean_reward": round(sum(d["reward"] for d in done) / len(done), 4),
        "step_walls_s": [round(d["step_s"], 3) for d in done],
    }


def run_ours(root: Path, model_dir: Path, rows: int, steps: int, offset: int) -> dict[str, Any]:
    """`steps` GRPO steps of `run_training` from `model_dir`; the median over steps
    FIRST_TIMED_STEP..`steps`, and `bench step`'s split of a step."""
    from benchmarks.bench_step import run_method

    overrides = {"model.path": str(model_dir), **sized_overrides(rows)}
    # no memory sampler: it would take CPU from ours that the plain loop keeps
    found = run_method("checkpoint", root, 0, steps, offset, overrides, sample_memory=False)
    # run_method's walls are of steps 2..steps (each after a GRPO step)
    walls = found["step_walls_s"][FIRST_TIMED_STEP - 2 :]
    return {"rows": rows, **found, "step_s": round(median(walls), 4)}


def main() -> None:
    """Make the SFT model (base/sft), then run plain and ours per row count; ratios last."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    parser.add_argument("--sft-steps", type=int, default=175, help="SFT steps of the shared model")
    parser.add_argument("--rows", default="256,64", help="rows a step, comma-separated")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--keep", type=Path, help="keep the run roots under this directory")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of plain and ours per row count"
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < FIRST_TIMED_STEP + 2:
        parser.error(f"--steps must be >= {FIRST_TIMED_STEP + 2}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.phase:
        print(json.dumps(_phase(args)))
        return
    row_counts = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        base = args.keep or Path(tmp)
        extra = ["--steps", str(args.steps), "--sft-steps", str(args.sft_steps)]
        sft = run_isolated(MODULE, "phase", "sft", base, extra, args.timeout_s)
        print(f"sft model: {sft}", flush=True)
        result: dict[str, Any] = {"steps": args.steps, **sft}
        for rows in row_counts:
            sized = [*extra, "--rows", str(rows), "--model-dir", str(base / "sft")]
            runs: dict[str, list[dict[str, Any]]] = {}
            for round_ in range(args.repeats):
                plain = run_isolated(MODULE, "phase", "plain", base, sized, args.timeout_s)
                runs.setdefault(f"plain_{rows}", []).append(plain)
                print(f"plain {rows:3d} rows: {plain['step_s']:.3f} s/step", flush=True)
                for offset in OFFSETS:
                    name = f"ours_{rows}_offset{offset}"
                    root = base / name / f"round{round_}"
                    ours = run_isolated(MODULE, "phase", name, root, sized, args.timeout_s)
                    runs.setdefault(name, []).append(ours)
                    ratio = ours["step_s"] / plain["step_s"]
                    print(f"{name}: {ours['step_s']:.3f} s/step, ratio {ratio:.3f}", flush=True)
            result.update(runs)
            for offset in OFFSETS:
                key = f"ratio_{rows}_offset{offset}"
                result.update(
                    round_ratios(key, runs[f"plain_{rows}"], runs[f"ours_{rows}_offset{offset}"])
                )
    ratios = {key: result[key] for key in GOALS if key in result}
    result["goals"] = GOALS
    result["goals_met"] = {key: value <= GOALS[key] for key, value in ratios.items()}
    print(json.dumps(result))


def round_ratios(
    key: str, plain: list[dict[str, Any]], ours: list[dict[str, Any]]
) -> dict[str, Any]:
    """`key`: the median of each round's ours / plain s/step; `key` with `ratios_` for
    `ratio_`: each round's."""
    each = [o["step_s"] / p["step_s"] for p, o in zip(plain, ours, strict=True)]
    return {
        key: round(median(each), 3),
        key.replace("ratio_", "ratios_", 1): [round(r, 3) for r in each],
    }


def _phase(args: argparse.Namespace) -> dict[str, Any]:
    """One run of `main`'s plan, in this process: `sft`, `plain` or `ours_<rows>_offset<k>`."""
    if args.phase == "sft":
        return make_sft_model(args.root, args.sft_steps)
    rows = int(args.rows)
    if args.phase == "plain":
        return run_plain(args.model_dir, rows, args.steps)
    offset = int(args.phase.rsplit("offset", 1)[1])
    return run_ours(args.root, args.model_dir, rows, args.steps, offset)


if __name__ == "__main__":
    main()
