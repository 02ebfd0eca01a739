"""Helpers for tests that need a whole tiny run: config, experiences, pinned batches."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.paths import RunPaths

TINY: dict[str, Any] = {
    "model": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 64,
        "max_position_embeddings": 32,
        "max_prompt_tokens": 16,
        "max_response_tokens": 8,
    },
    "algorithm": {"repeat_times": 4, "recompute_old_logprobs": True},
    "buffer": {"train_batch_size": 8},
    "trainer": {
        "total_steps": 6,
        "save_interval": 2,
        "micro_batch_size": 4,
        "sft_warmup_steps": 0,
    },
    # the single-digit task sets keep the tests' rollouts and evaluations small
    "explorer": {
        "taskset": "addition",
        "eval_taskset": "addition_eval",
        "tasks_per_step": 8,
        "eval_tasks": 16,
    },
    "service": {"idle_timeout_s": 900, "start_timeout_s": 240, "request_timeout_s": 600},
    "dagster": {"sensor_interval_s": 5},
}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in, recursively."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def tiny_config(tmp_path: Path, extra: dict[str, Any] | None = None) -> tuple[TrinityConfig, Path]:
    """A tiny-model run under `tmp_path/run`, and the YAML file it was loaded from."""
    data = merge(TINY, {"run_root": str(tmp_path / "run"), **(extra or {})})
    tmp_path.mkdir(parents=True, exist_ok=True)
    file = tmp_path / "config.yaml"
    file.write_text(yaml.safe_dump(data))
    return load_config(file), file


def vocab_size(config: TrinityConfig) -> int:
    """The vocabulary of the run's initial model (created if needed)."""
    from trinity_dagster.checkpoint.initial_weights import create_initial_model

    model_dir = create_initial_model(config, RunPaths.of(config.run_root))
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def synthetic_rows(
    config: TrinityConfig, groups: int, seed: int, model_version: int = 0
) -> list[dict[str, Any]]:
    """GRPO groups of random but valid experiences (varied rewards within each group)."""
    rng = random.Random(seed)
    vocab = vocab_size(config)
    repeat = config.algorithm.repeat_times
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 10))]
        group_id = f"g{seed}-{g}"
        for r in range(repeat):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            rows.append(
                {
                    "eid": str(uuid.UUID(int=rng.getrandbits(128))),
                    "task_id": f"t{seed}-{g}",
                    "group_id": group_id,
                    "explorer_id": "test",
                    "tokens": prompt + response,
                    "prompt_length": len(prompt),
                    "action_mask": [True] * len(response),
                    "logprobs": [-rng.uniform(1.0, 4.0) for _ in response],
                    "reward": float(r % 2) + rng.random() * 0.1,
                    "advantages": None,
                    "returns": None,
                    "model_version": model_version,
                    "created_at": datetime.now(UTC),
                    "info": "{}",
                }
            )
    return rows


def fill_buffer(config: TrinityConfig, steps: int, seed: int = 0) -> None:
    """Write enough experiences for `steps` train steps."""
    from trinity_dagster.buffer.writer import ExperienceWriter

    groups = steps * config.buffer.train_batch_size // config.algorithm.repeat_times
    report = ExperienceWriter(config).write(synthetic_rows(config, groups, seed))
    assert report.quarantined == 0, report


def pin_steps(config: TrinityConfig, steps: range) -> None:
    """Pin the batches of `steps` (in order)."""
    from trinity_dagster.buffer.sampler import PinResult, pin_batch

    for step in steps:
        assert isinstance(pin_batch(config, step, force=True), PinResult)


@dataclass
class ExploredRun:
    """What `train_beside_explorer` saw."""

    reason: str  # why training stopped
    versions: dict[int, int]  # weights version each explore step ran with
    loop: Any  # the `ExplorerLoop`
    while_up: Any  # what the `while_up` callback returned before the service stopped


def train_beside_explorer(
    config: TrinityConfig, explored: int, while_up: Callable[[], Any] = lambda: None
) -> ExploredRun:
    """Train `config` to 3 steps with the built-in explorer loop in a thread exploring steps
    1..`explored` (then marking the end of data if that is fewer), on an engine service
    started here, so `Trainer.run` leaves it up for `while_up`; the service stops after."""
    import asyncio
    import threading

    from trinity_dagster.explorer.loop import ExplorerLoop
    from trinity_dagster.handoff.end_of_data import mark_end_of_data
    from trinity_dagster.service.launcher import start_service, stop_service
    from trinity_dagster.trainer.trainer import Trainer

    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"total_steps": 3})}
    )
    paths = RunPaths.of(config.run_root)
    versions: dict[int, int] = {}
    loop = ExplorerLoop(
        config, on_step=lambda step, meta: versions.update({step: meta["weights_version"]})
    )

    def explore() -> None:
        loop.run(1, explored)
        if explored < 3:
            mark_end_of_data(paths, "explorer-0", "test data used up")

    explorer = threading.Thread(target=explore)
    explorer.start()
    try:
        start_service(config)
        reason = asyncio.run(Trainer(config).run())
        seen = while_up()
    finally:
        explorer.join(timeout=120)
        stop_service(paths)
    return ExploredRun(reason, versions, loop, seen)
