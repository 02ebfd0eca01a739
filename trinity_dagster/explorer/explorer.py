"""The built-in explorer: rollouts of published weights on a task set, as experience rows.

`Explorer.explore(step)` samples `explorer.tasks_per_step` tasks, generates
`algorithm.repeat_times` responses to each (one GRPO group per task), scores them with the
configured reward function and returns rows with the columns of the experience schema in
docs/architecture.md (without `ingest_seq`, which the buffer writer assigns). The tasks depend
only on (`explorer.seed`, step) and the sampling on (`explorer.seed`, step, explorer id), so
exploring a step twice with the same weights gives the same rows up to `eid` and `created_at`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trinity_dagster.checkpoint.layout import latest_weights_version
from trinity_dagster.checkpoint.shm_weights import read_shm_weights, shm_versions
from trinity_dagster.config import TrinityConfig
from trinity_dagster.explorer.generation import Generation, SamplingParams, generate
from trinity_dagster.explorer.policy import (
    copy_weights_into,
    load_policy,
    read_policy_weights,
    resolve_version,
)
from trinity_dagster.explorer.rewards import get_reward_fn
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import Task, TaskSet, load_taskset
from trinity_dagster.tokenizer import decode_response, encode_prompt, load_tokenizer
from trinity_dagster.weight_sync.announce import announced_version
from trinity_dagster.weight_sync.errors import WeightSyncError
from trinity_dagster.weight_sync.receiver import Received, receive_weights


def derive_seed(*parts: object) -> int:
    """A 63-bit seed determined by `parts` (stable across processes, unlike `hash`)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def encode_taskset(
    tokenizer: PreTrainedTokenizerBase, taskset: TaskSet, max_prompt_tokens: int
) -> dict[str, list[int]]:
    """Prompt ids per task id; a prompt too long or with unknown characters names its task."""
    encoded: dict[str, list[int]] = {}
    for task in taskset:
        where = f"task set {taskset.name!r}, task {task.task_id!r}"
        ids = encode_prompt(tokenizer, task.prompt, where)
        if len(ids) > max_prompt_tokens:
            raise ValueError(
                f"{where}: the prompt is {len(ids)} tokens, more than model.max_prompt_tokens "
                f"({max_prompt_tokens})"
            )
        encoded[task.task_id] = ids
    return encoded


class Explorer:
    """Generates experience rows with the published weights; keeps one model loaded."""

    def __init__(
        self, config: TrinityConfig, paths: RunPaths, explorer_id: str = "explorer-0"
    ) -> None:
        self.config = config
        self.paths = paths
        self.explorer_id = explorer_id
        self.taskset = load_taskset(config.explorer.taskset, config.explorer.seed)
        self.reward_fn = get_reward_fn(config.explorer.reward_fn)
        self.tokenizer = load_tokenizer(paths.tokenizer)
        self._prompt_ids = encode_taskset(
            self.tokenizer, self.taskset, config.model.max_prompt_tokens
        )
        self._model: PreTrainedModel | None = None
        self.loaded_version: int | None = None
        self.last_received: Received | None = None  # the newest collective transfer

    def policy(self, version: int) -> PreTrainedModel:
        """The model of weights `version`, updated only if another version is loaded now.

        Under `synchronizer.sync_method: memory` a version held in shared memory is copied
        into the loaded model in place, and under `nccl` the version the engine service holds
        is received into it over a collective group; any other version is read from its HF
        directory, into the loaded model in place when there is one (for the demo model a
        fresh load took 65 ms, an in-place copy 2 ms).
        """
        if self._model is None or self.loaded_version != version:
            self._model = self._load(version)
            self.loaded_version = version
        return self._model

    def _load(self, version: int) -> PreTrainedModel:
        """The model with weights `version`: the loaded one updated in place, or a fresh one
        from the version's HF directory. Under `nccl` a version that is neither announced nor
        on disk (the service holding it died since it was announced) raises
        `WeightSyncError`, which the loop answers by waiting for weights again."""
        method = self.config.synchronizer.sync_method
        if method == "memory" and version in shm_versions(self.paths):
            return self._update(read_shm_weights(self.paths, version))
        if method == "nccl" and version == announced_version(self.paths):
            return self._receive(version)
        try:
            if self._model is not None:
                return self._update(read_policy_weights(self.paths, version))
            return load_policy(self.paths, version)
        except FileNotFoundError as err:
            if method != "nccl":
                raise
            raise WeightSyncError(
                f"weights version {version} are neither announced by a live engine service "
                f"(the one that held them died) nor on disk under {self.paths.weights}"
            ) from err

    def _loaded_or_latest(self) -> PreTrainedModel:
        """The loaded model, or the newest published version loaded fresh to update."""
        return self._model or load_policy(self.paths, latest_weights_version(self.paths) or 0)

    def _update(self, tensors: Mapping[str, torch.Tensor]) -> PreTrainedModel:
        """The loaded model with `tensors` copied in; a failed copy leaves no model loaded."""
        model = self._loaded_or_latest()
        self._model, self.loaded_version = None, None
        copy_weights_into(model, tensors)
        return model

    def _receive(self, version: int) -> PreTrainedModel:
        """The loaded model with weights `version` received from the engine service in place;
        a failed transfer leaves no model loaded (part of it may have changed)."""
        model = self._loaded_or_latest()
        self._model, self.loaded_version = None, None
        self.last_received = receive_weights(
            self.paths, version, model.state_dict(), self.explorer_id
        )
        return model

    def sample_tasks(self, step: int) -> list[Task]:
        """The tasks of explore step `step` (a function of `explorer.seed` and `step`).

        With `buffer.total_epochs` set, explore steps walk through the task set epoch by
        epoch (each epoch a fresh permutation), so every task is used once per epoch.
        """
        per_step = self.config.explorer.tasks_per_step
        seed = self.config.explorer.seed
        if self.config.buffer.total_epochs is None:
            rng = random.Random(derive_seed("tasks", seed, step))
            return self.taskset.sample(per_step, rng)
        size = len(self.taskset)
        orders: dict[int, list[int]] = {}
        tasks = []
        for index in range((step - 1) * per_step, step * per_step):
            epoch, position = divmod(index, size)
            if epoch not in orders:
                orders[epoch] = list(range(size))
                random.Random(derive_seed("epoch", seed, epoch)).shuffle(orders[epoch])
            tasks.append(self.taskset.tasks[orders[epoch][position]])
        return tasks

    def explore(self, step: int, version: int | None = None) -> list[dict[str, Any]]:
        """Experience rows of step `step` from weights `version` (None: the latest published)."""
        version = resolve_version(self.paths, version)
        model = self.policy(version)
        tasks = self.sample_tasks(step)
        repeat = self.config.algorithm.repeat_times
        prompts = [self._prompt_ids[task.task_id] for task in tasks for _ in range(repeat)]
        generator = torch.Generator().manual_seed(
            derive_seed("sampling", self.config.explorer.seed, step, self.explorer_id)
        )
        params = SamplingParams(
            max_new_tokens=self.config.model.max_response_tokens,
            temperature=self.config.explorer.temperature,
            top_p=self.config.explorer.top_p,
        )
        generations = generate(
            model,
            prompts,
            params,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
        )
        created_at = datetime.now(UTC)
        rows = []
        for index, generation in enumerate(generations):
            slot = index // repeat
            task = tasks[slot]
            group_id = f"{self.explorer_id}:{step}:{slot}:{task.task_id}"
            eid = f"{self.explorer_id}:{step}:{index}"
            rows.append(
                self._row(task, eid, group_id, prompts[index], generation, version, created_at)
            )
        return rows

    def _row(
        self,
        task: Task,
        eid: str,
        group_id: str,
        prompt_ids: list[int],
        generation: Generation,
        version: int,
        created_at: datetime,
    ) -> dict[str, Any]:
        response = decode_response(self.tokenizer, generation.response_ids)
        info = {
            "taskset": self.taskset.name,
            "prompt": task.prompt,
            "answer": task.answer,
            "response": response,
            "finished": generation.finished,
            "temperature": self.config.explorer.temperature,
            "top_p": self.config.explorer.top_p,
        }
        return {
            "eid": eid,
            "task_id": task.task_id,
            "group_id": group_id,
            "explorer_id": self.explorer_id,
            "tokens": [*prompt_ids, *generation.response_ids],
            "prompt_length": len(prompt_ids),
            "action_mask": [True] * len(generation.response_ids),
            "logprobs": list(generation.logprobs),
            "reward": float(self.reward_fn(response, task.answer)),
            "advantages": None,
            "returns": None,
            "model_version": version,
            "created_at": created_at,
            "info": json.dumps(info),
        }
