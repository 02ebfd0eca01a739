"""Demonstration rows for the SFT warm-up: each task's correct answer as the response.

A row has the experience schema with the answer's tokens and `<eos>` as the response, reward
1.0 and log-probs 0.0 (the sft loss does not read them), and `info.demonstration = true`.
Consecutive rows share a `group_id` in groups of `algorithm.repeat_times` different tasks: the
buffer pins only whole groups of that size when `buffer.batch_unit` is "groups", and the sft
loss ignores groups, so each group holds distinct tasks rather than copies of one.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from typing import Any

from transformers import PreTrainedTokenizerBase

from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import load_taskset
from trinity_dagster.tokenizer import (
    build_tokenizer,
    decode_response,
    encode_prompt,
    encode_response,
    load_tokenizer,
)

DEMONSTRATION_EXPLORER_ID = "demonstrations"


def run_tokenizer(config: TrinityConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: `paths.tokenizer` if saved, else `model.path`'s or the built-in one."""
    saved = RunPaths.of_config(config).tokenizer
    if (saved / "tokenizer_config.json").is_file():
        return load_tokenizer(saved)
    if config.model.path is not None:
        return load_tokenizer(config.model.path)
    return build_tokenizer()


def demonstration_rows(
    config: TrinityConfig, n: int, seed: int, model_version: int = 0
) -> list[dict[str, Any]]:
    """`n` SFT rows from `explorer.taskset`, tasks drawn by `seed`, tagged with `model_version`."""
    group_size = config.algorithm.repeat_times
    if config.buffer.batch_unit == "groups" and n % group_size:
        raise ValueError(
            f"{n} demonstrations do not fill whole groups of algorithm.repeat_times "
            f"({group_size}), which buffer.batch_unit 'groups' needs"
        )
    taskset = load_taskset(config.explorer.taskset, config.explorer.seed)
    tokenizer = run_tokenizer(config)
    tasks = taskset.sample(n, random.Random(seed))
    created_at = datetime.now(UTC)
    rows = []
    for index, task in enumerate(tasks):
        where = f"task set {taskset.name!r}, task {task.task_id!r}"
        prompt_ids = encode_prompt(tokenizer, task.prompt, where)
        response_ids = encode_response(tokenizer, task.answer, where)
        _check_lengths(config, where, len(prompt_ids), len(response_ids))
        info = {
            "demonstration": True,
            "taskset": taskset.name,
            "prompt": task.prompt,
            "answer": task.answer,
            "response": decode_response(tokenizer, response_ids),
        }
        rows.append(
            {
                "eid": f"demo:{seed}:{index}",
                "task_id": task.task_id,
                "group_id": f"demo:{seed}:{index // group_size}",
                "explorer_id": DEMONSTRATION_EXPLORER_ID,
                "tokens": [*prompt_ids, *response_ids],
                "prompt_length": len(prompt_ids),
                "action_mask": [True] * len(response_ids),
                "logprobs": [0.0] * len(response_ids),
                "reward": 1.0,
                "advantages": None,
                "returns": None,
                "model_version": model_version,
                "created_at": created_at,
                "info": json.dumps(info),
            }
        )
    return rows


def _check_lengths(config: TrinityConfig, where: str, prompt: int, response: int) -> None:
    if prompt > config.model.max_prompt_tokens:
        raise ValueError(
            f"{where}: the prompt is {prompt} tokens, more than model.max_prompt_tokens "
            f"({config.model.max_prompt_tokens})"
        )
    if response > config.model.max_response_tokens:
        raise ValueError(
            f"{where}: the answer and <eos> are {response} tokens, more than "
            f"model.max_response_tokens ({config.model.max_response_tokens})"
        )
