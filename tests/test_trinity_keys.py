"""Trinity-RFT configs load as they are: its key paths act here or are refused with a reason.

The GSM8K configs under tests/trinity_configs/ are Trinity-RFT's own examples, copied verbatim.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resources.run_config import RunConfigResource
from trinity_dagster.config import ConfigError, load_config, start_fresh
from trinity_dagster.trinity_keys import TRINITY_KEYS, trinity_names

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((Path(__file__).parent / "trinity_configs").glob("*.yaml"))
# the keys of those examples that cannot act here (the same in all four)
REFUSED_IN_EXAMPLES = {
    "cluster",
    "buffer.explorer_input",
    "buffer.trainer_input.experience_buffer.name",
    "buffer.trainer_input.experience_buffer.storage_type",
    "buffer.trainer_input.experience_buffer.path",
    "explorer.eval_interval",
    "explorer.runner_per_model",
    "explorer.rollout_model",
    "trainer.trainer_type",
    "trainer.use_dynamic_bsz",
    "trainer.max_token_len_per_gpu",
}


def write(tmp_path: Path, data: dict | str, name: str = "c.yaml") -> Path:
    file = tmp_path / name
    file.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return file


def refused_lines(err: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    """{key path: why} of each refused key in a load error."""
    lines = str(err.value).splitlines()[1:]
    return dict(line.strip().split(": ", 1) for line in lines)


def without(data: dict, paths: set[str]) -> dict:
    """`data` less the keys at `paths`, and the sections that leaves empty."""
    for path in paths:
        *parents, leaf = path.split(".")
        chain = [data]
        for part in parents:
            chain.append(chain[-1][part])
        del chain[-1][leaf]
        for node, part in zip(reversed(chain[:-1]), reversed(parents), strict=True):
            if not node[part]:
                del node[part]
    return data


def test_every_refusal_says_what_to_do_instead() -> None:
    for key in TRINITY_KEYS:
        if key.kind == "refused":
            assert re.search(r"\bhere\b|\buse\b|remove", key.note), key


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_trinitys_gsm8k_examples_name_each_key_they_cannot_act_on(
    example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # Trinity takes a relative checkpoint_root_dir from here
    with pytest.raises(ConfigError) as err:
        load_config(example)
    lines = refused_lines(err)
    assert set(lines) == REFUSED_IN_EXAMPLES
    for key, why in lines.items():  # each says what to use here (or to remove the key)
        assert re.search(r"\bhere\b|\buse\b|remove", why), (key, why)

    # what the refusals ask for: drop those keys; the rest loads with Trinity's meaning
    data = without(yaml.safe_load(example.read_text()), REFUSED_IN_EXAMPLES)
    config = load_config(write(tmp_path, data))
    source = yaml.safe_load(example.read_text())
    assert config.run_root == str(tmp_path / "checkpoints" / source["project"] / source["name"])
    assert config.model.path == str(tmp_path / "Qwen/Qwen2.5-1.5B-Instruct")
    model = config.model
    assert (model.max_prompt_tokens, model.max_response_tokens) == (1024, 1024)
    algorithm = config.algorithm
    assert algorithm.algorithm_type == {"reinforceplusplus": "reinforce_plus_plus"}.get(
        source["algorithm"]["algorithm_type"], source["algorithm"]["algorithm_type"]
    )
    assert algorithm.repeat_times == 8
    assert (algorithm.kl_loss_fn, algorithm.kl_loss_coef) == ("k2", 0.001)  # Trinity's preset
    assert config.trainer.optim.lr == 1e-5  # `1e-5`: a string to YAML 1.1, a float to Trinity
    assert config.explorer.tasks_per_step == 96
    assert config.buffer.train_batch_size == 96 * 8  # batch_size x repeat_times
    assert config.buffer.total_epochs == 1
    assert config.trainer.save_interval == 100 and config.trainer.optim.grad_clip == 1.0
    sync = config.synchronizer
    assert (sync.sync_method, sync.sync_interval, sync.sync_timeout) == ("nccl", 1, 1200)


def test_an_environment_variable_names_the_checkpoint_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRINITY_CHECKPOINT_ROOT_DIR", str(tmp_path / "ckpt"))
    data = without(yaml.safe_load(EXAMPLES[0].read_text()), REFUSED_IN_EXAMPLES)
    data["checkpoint_root_dir"] = "${oc.env:TRINITY_CHECKPOINT_ROOT_DIR,./checkpoints}"
    data["group"] = "g1"
    config = load_config(write(tmp_path, data))
    assert config.run_root == str(tmp_path / "ckpt" / data["project"] / "g1" / data["name"])
    # without a project or a name, Trinity's defaults name the job directory and the run
    bare = load_config(write(tmp_path, {"checkpoint_root_dir": str(tmp_path)}, "bare.yaml"))
    assert bare.run_root == str(tmp_path / "Trinity-RFT" / "rft")
    assert (bare.project, bare.name) == ("Trinity-RFT", "rft")


@pytest.mark.parametrize(
    ("trinity", "ours"),
    [
        ({"algorithm": {"optimizer": {"betas": [0.8, 0.95]}}}, {"adam_beta1": 0.8}),
        (
            {"algorithm": {"optimizer": {"lr": 2e-5, "min_lr_ratio": 0.1}}},
            {"lr": 2e-5, "min_lr": pytest.approx(2e-6)},
        ),
        (
            {
                "trainer": {"total_steps": 50},
                "algorithm": {"optimizer": {"lr_warmup_steps_ratio": 0.1}},
            },
            {"lr_warmup_steps": 5},
        ),
        (
            {"algorithm": {"optimizer": {"lr_warmup_steps": 3, "lr_warmup_steps_ratio": 0.5}}},
            {"lr_warmup_steps": 3},
        ),
        ({"trainer": {"grad_clip": 0.5}}, {"grad_clip": 0.5}),
    ],
)
def test_optimizer_keys_act_on_the_trainers_optimizer(
    tmp_path: Path, trinity: dict, ours: dict
) -> None:
    optim = load_config(write(tmp_path, trinity)).trainer.optim
    assert {key: getattr(optim, key) for key in ours} == ours


def test_loss_arguments_act_on_the_algorithm(tmp_path: Path) -> None:
    data = {
        "algorithm": {
            "algorithm_type": "grpo",
            "policy_loss_fn_args": {"clip_range": 0.25, "clip_range_high": 0.3, "clip_ratio_c": 4},
            "kl_loss_fn": "low_var_kl",
            "kl_loss_fn_args": {"kl_coef": 0.01, "adaptive": False},
            "entropy_loss_fn_args": {"entropy_coef": 0.002},
            "advantage_fn_args": {"epsilon": 1e-5},
            "bypass_old_logprobs": False,
            "sample_strategy": "staleness_control",
            "sample_strategy_args": {"max_staleness": 2},
        }
    }
    config = load_config(write(tmp_path, data))
    algorithm = config.algorithm
    assert (algorithm.clip_range_low, algorithm.clip_range_high) == (0.25, 0.3)
    assert algorithm.dual_clip == 4
    assert (algorithm.kl_loss_fn, algorithm.kl_loss_coef) == ("low_var_kl", 0.01)
    assert algorithm.entropy_coef == 0.002 and algorithm.advantage_epsilon == 1e-5
    assert algorithm.recompute_old_logprobs
    assert (config.buffer.sample_strategy, config.buffer.max_staleness) == ("staleness_control", 2)


@pytest.mark.parametrize(
    ("data", "key", "says"),
    [
        (
            {"algorithm": {"kl_loss_fn_args": {"adaptive": True}}},
            "algorithm.kl_loss_fn_args",
            "adaptive KL controller",
        ),
        ({"algorithm": {"sample_strategy": "mix"}}, "algorithm.sample_strategy", "fifo"),
        (
            {"trainer": {"megatron": {"context_parallel_size": 2}}},
            "trainer.megatron",
            "context, expert and virtual-pipeline",
        ),
        (
            {"synchronizer": {"trainer_sync_interval": 2}},
            "synchronizer.trainer_sync_interval",
            "share one interval",
        ),
        ({"monitor": {"monitor_type": "swanlab"}}, "monitor.monitor_type", "tensorboard, mlflow"),
        (
            {"monitor": {"monitor_type": "wandb", "monitor_args": {"api_key": "k"}}},
            "monitor.monitor_args",
            "WANDB_API_KEY",
        ),
        ({"group": "g"}, "group", "checkpoint_root_dir"),
        (
            {"model": {"model_path": "/m", "path": "/n"}},
            "model.model_path",
            "given together with model.path",
        ),
    ],
)
def test_a_key_that_cannot_act_is_refused_with_one_line(
    tmp_path: Path, data: dict, key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data))
    lines = refused_lines(err)
    assert list(lines) == [key] and says in lines[key], str(err.value)


def test_refused_keys_load_with_the_value_that_is_what_happens_here(tmp_path: Path) -> None:
    data = {
        "continue_from_checkpoint": True,
        "trainer": {"use_dynamic_bsz": False, "ulysses_sequence_parallel_size": 1},
        "synchronizer": {"trainer_sync_interval": 1, "explorer_sync_interval": 1},
    }
    assert load_config(write(tmp_path, data)).synchronizer.sync_interval == 1


@pytest.mark.parametrize(
    ("value", "loaded"),
    [("NCCL", "nccl"), ("online", "nccl"), ("Offline", "checkpoint"), ("memory", "memory")],
)
def test_sync_methods_load_by_any_of_trinitys_names(value: str, loaded: str) -> None:
    assert load_config(None, {"synchronizer.sync_method": value}).synchronizer.sync_method == loaded


@pytest.mark.parametrize(
    ("style", "loaded"),
    [
        ("dynamic_by_explorer", "explorer_driven"),
        ("Dynamic_By_Trainer", "trainer_driven"),
        ("trainer_driven", "trainer_driven"),
        ("FULLY_ASYNC", "fully_async"),
    ],
)
def test_sync_styles_load_by_any_of_trinitys_names(style: str, loaded: str) -> None:
    config = load_config(None, {"synchronizer.sync_style": style})
    assert config.synchronizer.sync_style == loaded


def test_fully_async_refuses_an_offset_it_would_not_use() -> None:
    with pytest.raises(ConfigError, match="under sync_style fully_async they never wait"):
        load_config(None, {"synchronizer.sync_style": "fully_async", "synchronizer.sync_offset": 1})


@pytest.mark.parametrize("keep", [0, -1, None])
def test_zero_checkpoints_to_keep_keeps_all(keep: int | None) -> None:
    config = load_config(None, {"trainer.max_checkpoints_to_keep": keep})
    assert config.trainer.max_checkpoints_to_keep is None


def test_config_show_prints_trinitys_names_and_loads_back(tmp_path: Path) -> None:
    data = {
        "model": {"model_path": str(tmp_path)},
        "algorithm": {"algorithm_type": "rloo", "optimizer": {"lr": 3e-5}},
        "buffer": {"batch_size": 4, "train_batch_size": 32},
        "trainer": {"grad_clip": 0.7, "total_steps": 5},
        "run_root": str(tmp_path / "run"),
    }
    file = write(tmp_path, data)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "trinity-dagster"), "config", "show", "-c", str(file)],
        capture_output=True,
        text=True,
        check=True,
    )
    shown = yaml.safe_load(out.stdout)
    assert shown["model"]["model_path"] == str(tmp_path) and "path" not in shown["model"]
    assert shown["algorithm"]["optimizer"]["lr"] == 3e-5
    assert shown["trainer"]["grad_clip"] == 0.7 and "lr" not in shown["trainer"]["optim"]
    assert shown["buffer"]["batch_size"] == 4
    again = load_config(write(tmp_path, out.stdout, "shown.yaml"))
    assert again == load_config(file)
    assert trinity_names(again.model_dump(mode="json")) == shown


def test_docs_list_every_key_as_the_code_treats_it() -> None:
    """docs/trinity.md's table is the code's: each Trinity key with its kind and key here."""
    rows = re.findall(
        r"^\| `([^`]+)` \| (\w+) \| (?:`([^`]+)`|—) \|",
        (REPO / "docs" / "trinity.md").read_text(),
        flags=re.MULTILINE,
    )
    documented = [(path, kind, ours or None) for path, kind, ours in rows]
    assert documented == [(key.path, key.kind, key.ours) for key in TRINITY_KEYS]


def test_continue_from_checkpoint_false_trains_fresh_under_a_new_name(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    file = write(tmp_path, {"name": "exp", "run_root": "run", "continue_from_checkpoint": False})
    config = load_config(file)
    assert start_fresh(config) is config  # nothing to continue: the run root as given
    run_root.mkdir()
    (run_root / "config.yaml").write_text("name: exp\n")  # an earlier run

    fresh = start_fresh(config, now=dt.datetime(2026, 12, 4, 21, 0, 5))

    assert (fresh.name, fresh.run_root) == ("exp_20261204210005", f"{run_root}_20261204210005")
    assert fresh.continue_from_checkpoint  # a retry of the fresh run continues it
    assert (run_root / "config.yaml").read_text() == "name: exp\n"  # the old run is left alone
    # the code location cannot pick one fresh name for all its processes: it refuses
    with pytest.raises(ConfigError, match="`trinity-dagster run -c FILE` starts the fresh run"):
        _ = RunConfigResource(config_path=str(file)).config
    # nor can a fresh run share the old run's tables
    shared = config.model_copy(
        update={
            "buffer": config.buffer.model_copy(update={"tables_root": str(tmp_path / "tables")})
        }
    )
    with pytest.raises(ConfigError, match=r"point buffer\.tables_root at a new directory"):
        start_fresh(shared)
