"""A whole tiny run for tests and benchmarks: its config, random valid experiences, pinned
batches, and a free port on loopback. Not used by training itself."""

from __future__ import annotations

import copy
import json
import random
import socket
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from trinity_dagster.config import TrinityConfig, config_from_dict, load_config
from trinity_dagster.paths import RunPaths
from trinity_dagster.trinity_keys import set_dotted

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


def config_at(
    root: Path, sections: dict[str, Any], overrides: dict[str, Any] | None = None
) -> TrinityConfig:
    """`sections` (nested, as in a YAML file) with run root `root` and `overrides` (dotted
    keys, as `--set` takes them): the one way the tests build a config in memory."""
    data = copy.deepcopy(sections)
    data["run_root"] = str(root)
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return config_from_dict(data)


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
    if report.quarantined:
        raise RuntimeError(f"synthetic rows were quarantined: {report}")


def pin_steps(config: TrinityConfig, steps: range) -> None:
    """Pin the batches of `steps` (in order)."""
    from trinity_dagster.buffer.sampler import PinResult, pin_batch

    for step in steps:
        result = pin_batch(config, step, force=True)
        if not isinstance(result, PinResult):
            raise RuntimeError(f"step {step} could not be pinned: {result}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
