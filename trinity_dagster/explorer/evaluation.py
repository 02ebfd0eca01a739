"""Held-out evaluation of a weights version with greedy decoding.

Metrics over the first `n_tasks` tasks of `explorer.eval_taskset`:
- `eval/<taskset>/accuracy`: share of responses that `explorer.reward_fn` gives full credit
  (1.0): exact matches under `exact_match` and `partial_credit`, verified answers under
  `math_verify`;
- `eval/<taskset>/accuracy/ci95_low`, `.../ci95_high`: its 95% Wilson score interval;
- `eval/<taskset>/reward/mean`: mean of `explorer.reward_fn`;
- `eval/<taskset>/tasks`: how many tasks were scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trinity_dagster.config import TrinityConfig
from trinity_dagster.explorer.explorer import encode_taskset
from trinity_dagster.explorer.generation import SamplingParams, generate
from trinity_dagster.explorer.policy import load_policy
from trinity_dagster.explorer.rewards import RewardFn, get_reward_fn
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import Task, load_taskset
from trinity_dagster.tokenizer import decode_response, load_tokenizer

EVAL_BATCH_SIZE = 64
Z_95 = 1.959963984540054  # the standard normal quantile of 0.975


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for the default `z`)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def score_responses(
    taskset_name: str, tasks: Sequence[Task], responses: Sequence[str], reward_fn: RewardFn
) -> dict[str, float]:
    """Accuracy (with its Wilson interval) and mean reward of decoded `responses` to `tasks`,
    named for `taskset_name`."""
    if len(tasks) != len(responses) or not tasks:
        raise ValueError(
            f"need one response per task and at least one task, got {len(tasks)} tasks and "
            f"{len(responses)} responses"
        )
    rewards = [reward_fn(r, t.answer) for r, t in zip(responses, tasks, strict=True)]
    correct = sum(reward >= 1.0 for reward in rewards)
    low, high = wilson_interval(correct, len(rewards))
    name = f"eval/{taskset_name}"
    return {
        f"{name}/accuracy": correct / len(rewards),
        f"{name}/accuracy/ci95_low": low,
        f"{name}/accuracy/ci95_high": high,
        f"{name}/reward/mean": sum(rewards) / len(rewards),
        f"{name}/tasks": float(len(rewards)),
    }


def evaluate(
    config: TrinityConfig, paths: RunPaths, version: int, n_tasks: int | None = None
) -> dict[str, float]:
    """Greedy-decoding metrics of weights `version` on the held-out task set."""
    tokenizer = load_tokenizer(paths.tokenizer)
    return evaluate_policy(config, tokenizer, load_policy(paths, version), n_tasks)


def evaluate_policy(
    config: TrinityConfig,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    n_tasks: int | None = None,
) -> dict[str, float]:
    """Greedy-decoding metrics of a loaded `model` on the first `n_tasks` held-out tasks
    (default `explorer.eval_tasks`)."""
    taskset = load_taskset(config.explorer.eval_taskset, config.explorer.seed)
    count = config.explorer.eval_tasks if n_tasks is None else n_tasks
    if count < 1:
        raise ValueError(f"n_tasks must be >= 1, got {count}")
    tasks = taskset.head(count)
    prompt_ids = encode_taskset(tokenizer, taskset, config.model.max_prompt_tokens)
    params = SamplingParams(max_new_tokens=config.model.max_response_tokens, greedy=True)
    responses: list[str] = []
    for start in range(0, len(tasks), EVAL_BATCH_SIZE):
        chunk = tasks[start : start + EVAL_BATCH_SIZE]
        generations = generate(
            model,
            [prompt_ids[task.task_id] for task in chunk],
            params,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        responses += [decode_response(tokenizer, g.response_ids) for g in generations]
    return score_responses(taskset.name, tasks, responses, get_reward_fn(config.explorer.reward_fn))
