"""Held-out evaluation of a weights version with greedy decoding.

Metrics: `eval/<taskset>/accuracy` (share of exact matches) and `eval/<taskset>/reward/mean`
(mean of `explorer.reward_fn`), over the first `n_tasks` tasks of `explorer.eval_taskset`.
"""

from __future__ import annotations

from collections.abc import Sequence

from trinity_dagster.config import TrinityConfig
from trinity_dagster.explorer.explorer import encode_taskset
from trinity_dagster.explorer.generation import SamplingParams, generate
from trinity_dagster.explorer.policy import load_policy
from trinity_dagster.explorer.rewards import RewardFn, exact_match, get_reward_fn
from trinity_dagster.explorer.tasks import Task, load_taskset
from trinity_dagster.explorer.tokenizer import decode_response, load_tokenizer
from trinity_dagster.paths import RunPaths

EVAL_BATCH_SIZE = 64


def score_responses(
    taskset_name: str, tasks: Sequence[Task], responses: Sequence[str], reward_fn: RewardFn
) -> dict[str, float]:
    """Accuracy and mean reward of decoded `responses` to `tasks`, named for `taskset_name`."""
    if len(tasks) != len(responses) or not tasks:
        raise ValueError(
            f"need one response per task and at least one task, got {len(tasks)} tasks and "
            f"{len(responses)} responses"
        )
    pairs = list(zip(responses, tasks, strict=True))
    accuracy = sum(exact_match(r, t.answer) for r, t in pairs) / len(pairs)
    reward = sum(reward_fn(r, t.answer) for r, t in pairs) / len(pairs)
    return {f"eval/{taskset_name}/accuracy": accuracy, f"eval/{taskset_name}/reward/mean": reward}


def evaluate(
    config: TrinityConfig, paths: RunPaths, version: int, n_tasks: int | None = None
) -> dict[str, float]:
    """Greedy-decoding metrics of weights `version` on the held-out task set."""
    taskset = load_taskset(config.explorer.eval_taskset, config.explorer.seed)
    count = config.explorer.eval_tasks if n_tasks is None else n_tasks
    if count < 1:
        raise ValueError(f"n_tasks must be >= 1, got {count}")
    tasks = taskset.head(count)
    tokenizer = load_tokenizer(paths.tokenizer)
    prompt_ids = encode_taskset(tokenizer, taskset, config.model.max_prompt_tokens)
    model = load_policy(paths, version)
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
