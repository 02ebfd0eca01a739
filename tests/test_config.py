"""Configuration: defaults, YAML loading, and errors that name the file and key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from trinity_dagster.config import (
    ALGORITHM_ALIASES,
    ALGORITHM_PRESETS,
    ConfigError,
    TrinityConfig,
    check_inputs,
    load_config,
)
from trinity_dagster.service.server import check_bind_host


def write(tmp_path: Path, data: object, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_embedded_defaults_are_the_cpu_demo() -> None:
    cfg = load_config(None)
    assert cfg.megatron.world_size == 1
    assert cfg.model.path is None
    assert cfg.trainer.save_hf_checkpoint == "last"
    assert cfg.synchronizer.sync_method == "checkpoint"
    assert Path(cfg.run_root).is_absolute()


def test_trinity_field_names_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "run_root": "out",
            "trainer": {"total_steps": 7, "save_interval": 3, "save_hf_checkpoint": "always"},
            "synchronizer": {"sync_interval": 2, "sync_offset": 1, "sync_style": "fixed"},
            "buffer": {"train_batch_size": 16},
            "megatron": {"tensor_model_parallel_size": 2},
        },
    )
    cfg = load_config(path)
    assert cfg.trainer.total_steps == 7
    assert cfg.synchronizer.sync_offset == 1
    assert cfg.megatron.tensor_model_parallel_size == 2
    # a relative run root resolves against the file's directory, not the process cwd
    assert cfg.run_root == str((tmp_path / "out").resolve())


@pytest.mark.parametrize(
    ("data", "key_path", "detail"),
    [
        ({"trainer": {"total_stepz": 3}}, "trainer.total_stepz", "unknown key"),
        ({"trainer": {"total_steps": "many"}}, "trainer.total_steps", "integer"),
        ({"synchronizer": {"sync_interval": 0}}, "synchronizer.sync_interval", "greater than"),
        ({"synchronizer": {"sync_method": "rsync"}}, "synchronizer.sync_method", "checkpoint"),
        (
            {"trainer": {"save_hf_checkpoint": "sometimes"}},
            "trainer.save_hf_checkpoint",
            "always",
        ),
        (
            {"megatron": {"tensor_model_parallel_size": 3}},
            "megatron.tensor_model_parallel_size",
            "does not divide model.num_attention_heads",
        ),
        (
            {"model": {"num_attention_heads": 4, "num_query_groups": 3}},
            "model",
            "multiple of num_query_groups",
        ),
        (
            {"buffer": {"train_batch_size": 12}, "algorithm": {"repeat_times": 8}},
            "buffer.train_batch_size",
            "not a multiple of algorithm.repeat_times",
        ),
        (
            {"buffer": {"train_batch_size": 32}, "trainer": {"micro_batch_size": 5}},
            "trainer.micro_batch_size",
            "does not divide",
        ),
        (
            {"trainer": {"sequence_packing": True}, "megatron": {"sequence_parallel": True}},
            "trainer.sequence_packing",
            "megatron.sequence_parallel false",
        ),
        ({"service": {"host": "0.0.0.0"}}, "service.host", "allow_non_loopback"),
        ({"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip", "greater than 1"),
        (
            {"algorithm": {"algorithm_type": "ppo", "advantage_fn": "grpo"}},
            "algorithm.advantage_fn",
            "algorithm_type 'ppo' trains a critic to estimate advantages by GAE",
        ),
        ({"algorithm": {"lam": 0.95}}, "algorithm.lam", "only with advantage_fn 'ppo'"),
        ({"critic": {"warmup_steps": 2}}, "critic", "which advantage_fn 'grpo' does not train"),
        (
            {"algorithm": {"algorithm_type": "ppo"}, "megatron": {"sequence_parallel": True}},
            "megatron.sequence_parallel",
            "the critic's value head reads whole sequences",
        ),
        (
            {"algorithm": {"algorithm_type": "dapo"}},
            "algorithm.algorithm_type",
            "'grpo', 'rloo', 'reinforce_plus_plus', 'opmd', 'gspo' or 'sft'",
        ),
        ({"buffers": {}}, "buffers", "unknown key"),
        (
            {"megatron": {"pipeline_model_parallel_size": 2, "data_parallel_size": 1}},
            "megatron.pipeline_model_parallel_size",
            "the train engine has no pipeline schedule yet",
        ),
        (
            {"dagster": {"sensor_interval_s": 4}},
            "dagster.sensor_interval_s",
            "at least 5: Dagster's sensor daemon evaluates sensors at most every 5 s",
        ),
        (
            {"trainer": {"total_steps": None, "optim": {"lr_scheduler": "cosine"}}},
            "trainer.optim.lr_scheduler",
            "'cosine' decays to min_lr at trainer.total_steps, which is unset",
        ),
        (
            {"trainer": {"total_steps": None}, "algorithm": {"algorithm_type": "sft"}},
            "trainer.sft_warmup_steps",
            "set it, or trainer.total_steps",
        ),
    ],
)
def test_bad_config_names_file_and_key_path(
    tmp_path: Path, data: dict, key_path: str, detail: str
) -> None:
    path = write(tmp_path, data)
    message = error_of(path)
    assert str(path) in message
    assert f"  {key_path}: " in message
    assert detail in message


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "0.0.0.0", "192.0.2.1", "example.org"]
)
def test_config_and_service_agree_on_what_is_loopback(host: str) -> None:
    """A host the config accepts is one the service binds, and the other way round."""
    try:
        TrinityConfig(service={"host": host})
        config_accepts = True
    except ValidationError:
        config_accepts = False
    try:
        check_bind_host(host, allow_non_loopback=False)
        service_binds = True
    except PermissionError:
        service_binds = False
    assert config_accepts == service_binds


def test_several_mistakes_are_all_reported(tmp_path: Path) -> None:
    path = write(tmp_path, {"trainer": {"total_steps": 0, "seedd": 1}})
    message = error_of(path)
    assert "trainer.total_steps" in message
    assert "trainer.seedd: unknown key" in message


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "not found" in error_of(tmp_path / "absent.yaml")
    assert "invalid YAML" in error_of(write(tmp_path, "trainer: [unclosed", "bad.yaml"))
    assert "top level must be a mapping" in error_of(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


@pytest.mark.parametrize(
    ("text", "key_path", "lines"),
    [
        ("trainer:\n  total_steps: 3\nname: x\ntrainer:\n  seed: 1\n", "trainer", (1, 4)),
        ("model:\n  hidden_size: 64\n  hidden_size: 32\n", "model.hidden_size", (2, 3)),
        ("monitor:\n  backends: [{a: 1, a: 2}]\n", "monitor.backends[0].a", (2, 2)),
    ],
    ids=["section", "nested key", "flow mapping in a list"],
)
def test_a_key_given_twice_is_refused_with_its_path_and_both_lines(
    tmp_path: Path, text: str, key_path: str, lines: tuple[int, int]
) -> None:
    path = write(tmp_path, text)
    message = error_of(path)
    assert message == (
        f"invalid configuration in {path}: {key_path}: given twice, on lines {lines[0]} and "
        f"{lines[1]} (YAML would silently keep only the last)"
    )


def test_aliases_and_merge_keys_are_no_duplicates(tmp_path: Path) -> None:
    text = "trainer: {<<: {seed: 1}, seed: &s 7}\nexplorer:\n  seed: *s\n"
    cfg = load_config(write(tmp_path, text))
    assert (cfg.trainer.seed, cfg.explorer.seed) == (7, 7)


def test_inputs_that_exist_pass_and_outputs_need_not_exist(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    data = {
        "run_root": "not/yet",
        "buffer": {"tables_root": "tables/not/yet"},
        "model": {"path": "model"},
        "explorer": {"taskset": "tasks.jsonl", "eval_taskset": "addition_eval"},
    }
    check_inputs(load_config(write(tmp_path, data)))
    check_inputs(load_config(None))  # the built-in task sets need no file


@pytest.mark.parametrize(
    ("data", "missing"),
    [
        ({"explorer": {"taskset": "a.jsonl"}}, "explorer.taskset: no such task file: {}/a.jsonl"),
        (
            {"explorer": {"eval_taskset": "b.jsonl"}},
            "explorer.eval_taskset: no such task file: {}/b.jsonl",
        ),
        ({"model": {"path": "hf"}}, "model.path: no such directory: {}/hf"),
        (
            {"model": {"path": "hf"}, "explorer": {"taskset": "a.jsonl"}},
            "model.path: no such directory: {0}/hf; explorer.taskset: no such task file: "
            "{0}/a.jsonl",
        ),
    ],
)
def test_a_missing_input_is_named_with_its_key_path_and_path(
    tmp_path: Path, data: dict, missing: str
) -> None:
    config = load_config(write(tmp_path, data))
    with pytest.raises(ConfigError) as err:
        check_inputs(config)
    assert str(err.value) == f"missing input: {missing.format(tmp_path.resolve())}"


def test_a_task_set_that_is_neither_built_in_nor_a_file_is_named(tmp_path: Path) -> None:
    config = load_config(None, {"explorer.taskset": "two_digit_adition"})
    with pytest.raises(ConfigError) as err:
        check_inputs(config)
    assert "explorer.taskset: 'two_digit_adition' is neither a built-in task set" in str(err.value)


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "", "empty.yaml")).trainer.total_steps == (
        TrinityConfig().trainer.total_steps
    )


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, {"trainer": {"total_steps": 5}}))
    again = load_config(write(tmp_path, cfg.to_yaml(), "resolved.yaml"))
    assert again == cfg
    assert again.resolved_hash() == cfg.resolved_hash()


def test_overrides_use_dotted_keys(tmp_path: Path) -> None:
    cfg = load_config(None, overrides={"trainer.total_steps": 3, "run_root": str(tmp_path)})
    assert cfg.trainer.total_steps == 3
    with pytest.raises(ConfigError, match=r"trainer\.bogus: unknown key"):
        load_config(None, overrides={"trainer.bogus": 1})


def test_demo_example_spells_out_the_embedded_defaults() -> None:
    example = load_config(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml")
    defaults = load_config(None, overrides={"run_root": example.run_root})
    assert example == defaults


@pytest.mark.parametrize(
    "name",
    ["grpo_jsonl.yaml", "grpo_math.yaml", "sft_only.yaml", "trinity_gsm8k_rloo.yaml", "ppo.yaml"],
)
def test_examples_load(name: str) -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / name)
    assert Path(cfg.run_root).is_absolute()


@pytest.mark.parametrize("name", list(ALGORITHM_PRESETS))
def test_each_preset_is_an_algorithm_type_that_loads(name: str) -> None:
    algorithm = load_config(None, overrides={"algorithm.algorithm_type": name}).algorithm
    assert algorithm.algorithm_type == name
    for key, value in ALGORITHM_PRESETS[name].items():
        assert getattr(algorithm, key) == value


@pytest.mark.parametrize(
    ("algorithm_type", "selected"),
    [
        ("rloo", {"advantage_fn": "rloo", "policy_loss_fn": "ppo"}),
        ("reinforce_plus_plus", {"advantage_fn": "reinforce_plus_plus"}),
        ("opmd", {"advantage_fn": "opmd", "policy_loss_fn": "ppo"}),
        (
            "gspo",
            {
                "advantage_fn": "grpo",
                "policy_loss_fn": "gspo",
                "clip_range_low": 3e-4,
                "clip_range_high": 4e-4,
                "loss_agg_mode": "seq-mean-token-mean",
            },
        ),
        ("sft", {"policy_loss_fn": "sft"}),
        ("ppo", {"advantage_fn": "ppo", "repeat_times": 1, "gamma": 1.0, "lam": 1.0}),
    ],
)
def test_algorithm_type_selects_its_defaults(algorithm_type: str, selected: dict) -> None:
    algorithm = load_config(None, {"algorithm.algorithm_type": algorithm_type}).algorithm
    assert {key: getattr(algorithm, key) for key in selected} == selected


@pytest.mark.parametrize("name", ["ppo", "grpo", "GRPO", "rloo", "reinforceplusplus", "opmd"])
def test_a_named_algorithm_type_takes_trinity_rfts_loss_defaults(name: str) -> None:
    """Trinity-RFT's presets: symmetric clip 0.2, dual-clip 3, k2 KL loss at 0.001."""
    algorithm = load_config(None, {"algorithm.algorithm_type": name}).algorithm
    assert algorithm.algorithm_type == {"GRPO": "grpo"}.get(name, ALGORITHM_ALIASES.get(name, name))
    got = (algorithm.policy_loss_fn, algorithm.clip_range_low, algorithm.clip_range_high)
    assert got == ("ppo", 0.2, 0.2)
    assert (algorithm.dual_clip, algorithm.kl_loss_fn, algorithm.kl_loss_coef) == (3.0, "k2", 1e-3)
    assert algorithm.uses_reference_model


def test_without_an_algorithm_type_the_demos_grpo_applies() -> None:
    algorithm = load_config(None, {"algorithm.repeat_times": 4}).algorithm
    assert (algorithm.algorithm_type, algorithm.clip_range_high) == ("grpo", 0.28)
    assert (algorithm.dual_clip, algorithm.kl_loss_fn) == (None, "none")
    assert not algorithm.uses_reference_model


def test_keys_set_in_the_file_override_the_algorithm_type(tmp_path: Path) -> None:
    data = {
        "algorithm": {"algorithm_type": "gspo", "clip_range_high": 0.01, "advantage_fn": "rloo"}
    }
    algorithm = load_config(write(tmp_path, data)).algorithm
    assert (algorithm.clip_range_high, algorithm.advantage_fn) == (0.01, "rloo")
    assert (algorithm.policy_loss_fn, algorithm.clip_range_low) == ("gspo", 3e-4)


def test_sft_type_makes_every_step_an_sft_step_unless_told_otherwise() -> None:
    sft = {"algorithm.algorithm_type": "sft", "trainer.total_steps": 12}
    assert load_config(None, sft).trainer.sft_warmup_steps == 12
    told = load_config(None, {**sft, "trainer.sft_warmup_steps": 5})
    assert told.trainer.sft_warmup_steps == 5
