"""Trinity-RFT's configuration keys: the ones that load here, under which key, and the ones
refused.

A Trinity-RFT YAML file loads as it is. `translate` moves each of Trinity's key paths to this
project's key, converting the value where the two differ in form, and refuses each key that
cannot act here with one line that says what the key is for in Trinity and what to use
instead. Keys of this project's own pass through unchanged, so unknown keys stay errors.
`TRINITY_KEYS` is the table docs/trinity.md lists; `trinity_names` prints a resolved
configuration under Trinity's names where a key is only renamed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["same", "alias", "converted", "refused"]
Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


class TrinityKeyError(ValueError):
    """Trinity-RFT keys that cannot act here; one `key path: why` line each."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class TrinityKey:
    """One of Trinity-RFT's key paths (a whole subtree when it holds a mapping)."""

    path: str
    kind: Kind
    ours: str | None  # this project's key (`same`, `alias`, `converted`)
    note: str  # how the value maps, or why the key is refused and what to use instead
    convert: Convert | None = None  # `converted`: (value, whole file) -> {our key: value}
    accepts: tuple[Any, ...] = ()  # `refused` keys load when their value is one of these


def _same(path: str, note: str = "") -> TrinityKey:
    return TrinityKey(path, "same", path, note)


def _alias(path: str, ours: str, note: str = "") -> TrinityKey:
    return TrinityKey(path, "alias", ours, note)


def _converted(path: str, ours: str, note: str, convert: Convert) -> TrinityKey:
    return TrinityKey(path, "converted", ours, note, convert)


def _refused(path: str, why: str, accepts: tuple[Any, ...] = ()) -> TrinityKey:
    return TrinityKey(path, "refused", None, why, accepts=accepts)


def _dotted(data: Mapping[str, Any], path: str, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


_TRINITY_NAMES = {"project": "Trinity-RFT", "name": "rft"}  # Trinity's defaults


def _run_root(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """Trinity's job directory: `<checkpoint_root_dir>/<project>/<group>/<name>`, a relative
    root taken from the working directory as Trinity does; a missing project or name takes
    Trinity's default."""
    names = {key: str(data.get(key, default)) for key, default in _TRINITY_NAMES.items()}
    parts = [str(value), names["project"], str(data.get("group", "")), names["name"]]
    missing = {key: names[key] for key in _TRINITY_NAMES if key not in data}
    return {"run_root": os.path.abspath(os.path.join(*parts)), **missing}


def _group(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if "checkpoint_root_dir" not in data:
        raise ValueError(
            "is a directory level of Trinity's job directory, read with checkpoint_root_dir; "
            "give checkpoint_root_dir too, or set run_root"
        )
    return {}


def _betas(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise ValueError(f"expected [beta1, beta2], got {value!r}")
    return {"trainer.optim.adam_beta1": value[0], "trainer.optim.adam_beta2": value[1]}


def _min_lr(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    lr = _dotted(data, "algorithm.optimizer.lr", _dotted(data, "trainer.optim.lr", 5e-5))
    return {"trainer.optim.min_lr": float(value) * float(lr)}


def _warmup_steps(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """Trinity's -1 means "use lr_warmup_steps_ratio"."""
    if int(value) >= 0:
        return {"trainer.optim.lr_warmup_steps": int(value)}
    ratio = float(_dotted(data, "algorithm.optimizer.lr_warmup_steps_ratio", 0.0))
    return {"trainer.optim.lr_warmup_steps": _ratio_steps(ratio, data)}


def _warmup_ratio(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if int(_dotted(data, "algorithm.optimizer.lr_warmup_steps", -1)) >= 0:
        return {}  # Trinity: explicit steps win over the ratio
    return {"trainer.optim.lr_warmup_steps": _ratio_steps(float(value), data)}


def _ratio_steps(ratio: float, data: Mapping[str, Any]) -> int:
    if ratio == 0:
        return 0
    total = _dotted(data, "trainer.total_steps")
    if total is None:
        raise ValueError(
            "a warm-up ratio needs trainer.total_steps (training until the data ends has no "
            "length); give algorithm.optimizer.lr_warmup_steps instead"
        )
    return int(ratio * int(total))


def _sample_strategy(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    named = {"default": "fifo", "warmup": "fifo", "staleness_control": "staleness_control"}
    if value not in named:
        raise ValueError(
            f"{value!r} is not supported: 'default' (read in order) loads as "
            "buffer.sample_strategy fifo, 'staleness_control' as itself; buffer.sample_strategy "
            "also offers 'priority'"
        )
    return {"buffer.sample_strategy": named[value]}


def _staleness_args(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    return _args(value, {"max_staleness": "buffer.max_staleness"})


def _advantage_args(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    keys = {"epsilon": "algorithm.advantage_epsilon", "gamma": "algorithm.gamma"}
    keys |= {"tau": "algorithm.opmd_tau", "lam": "algorithm.lam"}
    return _args(value, keys)


def _policy_loss_args(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    value = dict(value)
    out: dict[str, Any] = {}
    if "clip_range" in value:  # the symmetric clip; clip_range_low/high override each side
        clip = value.pop("clip_range")
        out |= {"algorithm.clip_range_low": clip, "algorithm.clip_range_high": clip}
    if value.get("enable_sequence_masking"):
        raise ValueError("enable_sequence_masking is not implemented here; remove it")
    value.pop("enable_sequence_masking", None)
    value.pop("delta_sequence_masking", None)  # only read with sequence masking on
    keys = {
        "clip_range_low": "algorithm.clip_range_low",
        "clip_range_high": "algorithm.clip_range_high",
        "clip_ratio_c": "algorithm.dual_clip",
        "loss_agg_mode": "algorithm.loss_agg_mode",
    }
    return out | _args(value, keys)


def _kl_args(ours: str) -> Convert:
    def convert(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(value, Mapping) and value.get("adaptive"):
            raise ValueError("the adaptive KL controller is not implemented; set adaptive false")
        rest = {k: v for k, v in dict(value).items() if k != "adaptive"}
        return _args(rest, {"kl_coef": ours})

    return convert


def _entropy_fn(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if value == "none":
        return {"algorithm.entropy_coef": 0.0}
    if value == "default":
        return {}
    raise ValueError(f"{value!r} is not supported: 'default' (coefficient entropy_coef) or 'none'")


def _entropy_args(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if _dotted(data, "algorithm.entropy_loss_fn") == "none":
        return {}
    return _args(value, {"entropy_coef": "algorithm.entropy_coef"})


def _args(value: Any, keys: Mapping[str, str]) -> dict[str, Any]:
    """A Trinity `*_args` mapping as this project's keys; an argument without one is refused."""
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(
            f"argument(s) {', '.join(unknown)} not supported here (supported: {', '.join(keys)})"
        )
    return {keys[k]: v for k, v in value.items()}


def _bypass_old_logprobs(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    return {"algorithm.recompute_old_logprobs": not bool(value)}


def _max_model_len(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """Trinity derives the prompt and response budgets from `max_model_len`."""
    total = int(value)
    prompt = _dotted(data, "model.max_prompt_tokens")
    response = _dotted(data, "model.max_response_tokens")
    if prompt is not None and response is not None:
        if int(prompt) + int(response) != total:
            raise ValueError(
                f"{total} is not model.max_prompt_tokens ({prompt}) + model.max_response_tokens "
                f"({response}); the trainer accepts sequences of their sum"
            )
        return {}
    if response is not None:
        return {"model.max_prompt_tokens": total - int(response)}
    if prompt is not None:
        return {"model.max_response_tokens": total - int(prompt)}
    return {"model.max_prompt_tokens": total // 2, "model.max_response_tokens": total - total // 2}


def _monitor_type(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if value not in ("tensorboard", "mlflow", "wandb"):
        raise ValueError(
            f"{value!r} is not supported: monitor.backends offers tensorboard, mlflow, wandb "
            "and jsonl"
        )
    return {"monitor.backends": [value]}


def _monitor_args(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    kind = _dotted(data, "monitor.monitor_type", "tensorboard")
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    secrets = sorted({"api_key", "username", "password"} & set(value))
    if secrets:
        raise ValueError(
            f"{', '.join(secrets)}: set them in the environment here (WANDB_API_KEY, "
            "MLFLOW_TRACKING_USERNAME/PASSWORD): a config file's values reach logs and the "
            "tracked run's parameters"
        )
    if kind == "mlflow":
        return _args(value, {"uri": "monitor.mlflow_tracking_uri"})
    if kind == "wandb":
        return _args(value, {"base_url": "monitor.wandb_base_url"})
    return _args(value, {})


def _mode(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if value == "both":
        return {}
    if value == "train":
        return {"dagster.builtin_explorer": False}
    raise ValueError(
        f"{value!r} is not supported: 'both' (the built-in explorer beside the trainer) or "
        "'train' (trainer only: another explorer writes the experiences table)"
    )


def _trainer_megatron(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel")
    out = {f"megatron.{k}": v for k, v in value.items() if k in keys}
    unity = {
        "virtual_pipeline_model_parallel_size": None,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
        "context_parallel_size": 1,
    }
    for key in sorted(set(value) - set(keys)):
        if key not in unity:
            raise ValueError(f"{key}: unknown Megatron parallelism key")
        if value[key] not in (unity[key], 1):
            raise ValueError(
                f"{key} {value[key]!r}: only tensor, pipeline and data parallelism are "
                "implemented (megatron.*); context, expert and virtual-pipeline parallelism "
                "are not"
            )
    return out


def _interval(which: str) -> Convert:
    def convert(value: Any, data: Mapping[str, Any]) -> dict[str, Any]:
        base = _dotted(data, "synchronizer.sync_interval", 1)
        if value is not None and value != base:
            raise ValueError(
                f"{value} differs from synchronizer.sync_interval ({base}); here the trainer "
                f"and the explorers share one interval: set sync_interval instead of the "
                f"{which}'s own"
            )
        return {}

    return convert


_EXPLORER = (
    "configures Trinity's explorer (rollout engines, workflows, runners); the built-in "
    "explorer here is set by explorer.taskset, eval_taskset, reward_fn, tasks_per_step, "
    "temperature, top_p and step_timeout_s"
)
_GENERATION = (
    "is a rollout (generation) option of Trinity's inference engine; the built-in explorer "
    "here samples with explorer.temperature and explorer.top_p only: remove the key"
)
_FSDP = "is an FSDP option of Trinity's verl trainer; the Megatron-core engine here has none"
_TOKEN_BUDGET = (
    "sizes micro-batches by a token budget; here micro-batches hold trainer.micro_batch_size "
    "rows, and trainer.sequence_packing removes padding"
)

TRINITY_KEYS: tuple[TrinityKey, ...] = (
    # top level
    _same("project"),
    _same("name"),
    _converted(
        "checkpoint_root_dir",
        "run_root",
        "`run_root` = `<checkpoint_root_dir>/<project>/<group>/<name>`, Trinity's job directory",
        _run_root,
    ),
    _converted("group", "run_root", "a directory level of `run_root` (see above)", _group),
    _same(
        "continue_from_checkpoint",
        "false: a run root in use is left alone; `run` trains fresh in `<run_root>_<stamp>`",
    ),
    _converted(
        "mode",
        "dagster.builtin_explorer",
        "`both`: the built-in explorer runs (default); `train`: `builtin_explorer: false`",
        _mode,
    ),
    _refused(
        "cluster",
        "sizes Trinity's Ray cluster; here the engine's ranks are set by megatron.* "
        "and service.nnodes / service.nproc_per_node",
    ),
    _refused("ray_namespace", "names Trinity's Ray namespace; there is no Ray here"),
    _refused("data_processor", "configures Trinity's data pipelines (Data-Juicer); none here"),
    _refused(
        "stages",
        "runs Trinity's multi-stage configs; run one config per stage here "
        "(trainer.sft_warmup_steps gives an SFT warm-up in one run)",
    ),
    _refused("service.data_juicer", "starts Trinity's Data-Juicer service; none here"),
    _refused("ignore_validator_suggestions", "skips Trinity's GPU-memory estimate; none here"),
    _alias("log.level", "monitor.log_level"),
    _refused(
        "log.group_by_node",
        "groups Trinity's Ray logs by node; logs here are per process under the run root's logs/",
    ),
    # model
    _alias("model.model_path", "model.path", "a local HF directory (no hub download)"),
    _same("model.max_prompt_tokens"),
    _same("model.max_response_tokens"),
    _converted(
        "model.max_model_len",
        "model.max_prompt_tokens",
        "derives the prompt/response budget as Trinity does (the sum must match when both set)",
        _max_model_len,
    ),
    _same("model.rope_theta", "for the built model; an HF directory has its own"),
    _alias("model.temperature", "explorer.temperature"),
    _alias("model.top_p", "explorer.top_p"),
    *(
        _refused(f"model.{key}", _GENERATION)
        for key in (
            "top_k",
            "logprobs",
            "min_response_tokens",
            "repetition_penalty",
            "enable_prompt_truncation",
            "enable_thinking",
            "custom_chat_template",
            "chat_template_path",
        )
    ),
    _refused(
        "model.trust_remote_code",
        "loads custom model code; only Llama/Qwen2 directories load here, with no remote code",
        accepts=(False,),
    ),
    _alias(
        "model.critic_model_path",
        "critic.model_path",
        "PPO's value model; an HF causal-LM or token-classification directory",
    ),
    _refused("model.lora_configs", "trains LoRA adapters; LoRA is not implemented here"),
    _refused("model.fully_sharded_loras", "a LoRA option; LoRA is not implemented here"),
    _refused("model.max_cpu_loras", "a LoRA option; LoRA is not implemented here"),
    _refused("model.rope_scaling", "scales RoPE; the models here lack it: remove it"),
    _refused("model.tinker", "trains through the Tinker API; the engine here is local"),
    _refused("model.external_model", "benchmarks an external API model; no bench mode here"),
    # algorithm
    _same("algorithm.algorithm_type", "presets as Trinity's; `reinforceplusplus` and any case"),
    _same("algorithm.repeat_times"),
    _same("algorithm.advantage_fn", "grpo, rloo, reinforceplusplus, opmd"),
    _same("algorithm.policy_loss_fn", "ppo, gspo, sft"),
    _same("algorithm.kl_loss_fn"),
    _same("algorithm.kl_penalty_fn"),
    _same("algorithm.loss_agg_mode"),
    _alias("algorithm.optimizer.lr", "trainer.optim.lr"),
    _alias("algorithm.optimizer.lr_scheduler_type", "trainer.optim.lr_scheduler"),
    _alias("algorithm.optimizer.optimizer_type", "trainer.optim.optimizer"),
    _alias("algorithm.optimizer.weight_decay", "trainer.optim.weight_decay"),
    _converted("algorithm.optimizer.betas", "trainer.optim.adam_beta1", "`[b1, b2]`", _betas),
    _converted(
        "algorithm.optimizer.min_lr_ratio",
        "trainer.optim.min_lr",
        "`min_lr` = ratio x lr",
        _min_lr,
    ),
    _converted(
        "algorithm.optimizer.lr_warmup_steps",
        "trainer.optim.lr_warmup_steps",
        "-1 (Trinity's default) uses the ratio below",
        _warmup_steps,
    ),
    _converted(
        "algorithm.optimizer.lr_warmup_steps_ratio",
        "trainer.optim.lr_warmup_steps",
        "ratio x trainer.total_steps",
        _warmup_ratio,
    ),
    _refused(
        "algorithm.optimizer.warmup_style",
        "is Trinity's old name of lr_scheduler_type; use algorithm.optimizer.lr_scheduler_type",
    ),
    _refused(
        "algorithm.optimizer.clip_grad",
        "is not read for the actor in Trinity (its trainer.grad_clip is); use trainer.grad_clip",
    ),
    _refused("algorithm.optimizer.fused", _FSDP),
    _refused("algorithm.optimizer.foreach", _FSDP),
    _converted(
        "algorithm.sample_strategy",
        "buffer.sample_strategy",
        "`default` -> `fifo`, `staleness_control` -> itself",
        _sample_strategy,
    ),
    _converted(
        "algorithm.sample_strategy_args",
        "buffer.max_staleness",
        "`max_staleness`",
        _staleness_args,
    ),
    _converted(
        "algorithm.advantage_fn_args",
        "algorithm.advantage_epsilon",
        "`epsilon` -> advantage_epsilon, `gamma` -> gamma, `lam` -> lam, `tau` -> opmd_tau",
        _advantage_args,
    ),
    _converted(
        "algorithm.policy_loss_fn_args",
        "algorithm.clip_range_low",
        "`clip_range` (both sides), `clip_range_low/high`, `clip_ratio_c` -> dual_clip, "
        "`loss_agg_mode`",
        _policy_loss_args,
    ),
    _converted(
        "algorithm.kl_loss_fn_args",
        "algorithm.kl_loss_coef",
        "`kl_coef`",
        _kl_args("algorithm.kl_loss_coef"),
    ),
    _converted(
        "algorithm.kl_penalty_fn_args",
        "algorithm.kl_penalty_coef",
        "`kl_coef`",
        _kl_args("algorithm.kl_penalty_coef"),
    ),
    _converted(
        "algorithm.entropy_loss_fn",
        "algorithm.entropy_coef",
        "`default` (coefficient from the args), `none` -> 0",
        _entropy_fn,
    ),
    _converted(
        "algorithm.entropy_loss_fn_args",
        "algorithm.entropy_coef",
        "`entropy_coef`",
        _entropy_args,
    ),
    _converted(
        "algorithm.bypass_old_logprobs",
        "algorithm.recompute_old_logprobs",
        "its negation",
        _bypass_old_logprobs,
    ),
    _refused(
        "algorithm.enable_router_replay", "replays MoE routing; MoE models are not supported here"
    ),
    _refused(
        "algorithm.rollout_correction",
        "corrects off-policy rollouts (importance sampling); not implemented here",
    ),
    # buffer
    _alias("buffer.batch_size", "explorer.tasks_per_step", "tasks per explore step"),
    _same(
        "buffer.train_batch_size",
        "0 or absent with buffer.batch_size: batch_size x repeat_times, as Trinity",
    ),
    _same("buffer.total_epochs"),
    _refused(
        "buffer.total_steps",
        "bounds Trinity's explorer by steps; here trainer.total_steps bounds both sides",
    ),
    _refused(
        "buffer.explorer_input",
        "holds Trinity's task sets, workflows and reward "
        "functions; the built-in explorer here reads explorer.taskset (a built-in set or "
        "a JSONL file of prompt/answer tasks), explorer.eval_taskset and "
        "explorer.reward_fn",
    ),
    _alias(
        "buffer.trainer_input.experience_buffer.max_read_timeout",
        "buffer.read_timeout_s",
    ),
    _alias(
        "buffer.trainer_input.experience_buffer.capacity",
        "buffer.capacity",
        "unconsumed experiences before the built-in explorer waits for room",
    ),
    *(
        _refused(
            f"buffer.trainer_input.experience_buffer.{key}",
            "chooses Trinity's experience storage (queue, SQL, file); experiences here are "
            "Delta tables under buffer.tables_root (default: the run root)",
        )
        for key in (
            "name",
            "storage_type",
            "path",
            "max_retry_times",
            "max_retry_interval",
        )
    ),
    _refused(
        "buffer.trainer_input.experience_buffer.replay_buffer",
        "replays experiences by priority; use buffer.sample_strategy: priority with "
        "buffer.reuse_limit",
    ),
    _refused(
        "buffer.trainer_input.auxiliary_buffers",
        "feeds extra data (SFT/mix) to Trinity's trainer; not supported here",
    ),
    # explorer
    *(
        _refused(f"explorer.{key}", _EXPLORER)
        for key in (
            "name",
            "runner_per_model",
            "runner_prepare_concurrency",
            "runner_prepare_max_retries",
            "max_timeout",
            "max_retry_times",
            "env_vars",
            "concurrent_mode",
            "max_repeat_times_per_runner",
            "runner_num",
            "rollout_model",
            "auxiliary_models",
            "bench_on_latest_checkpoint",
            "proxy_port",
            "listen_address",
            "service_status_check_interval",
            "min_running_model_num",
            "db_url",
            "over_rollout",
            "dynamic_timeout",
            "runner_state_report_interval",
            "max_inflight_batches",
        )
    ),
    _refused(
        "explorer.eval_interval",
        "evaluates every N explore steps in Trinity; here "
        "evaluation runs on a schedule (dagster.eval_cron), after training, and from "
        "the UI",
    ),
    _refused(
        "explorer.eval_on_startup",
        "evaluates the initial weights first in Trinity; here "
        "the evaluation after training scores them",
    ),
    # trainer
    _refused("trainer.name", "names Trinity's Ray trainer actor; there is no Ray here"),
    _refused(
        "trainer.trainer_type",
        "chooses Trinity's trainer backend (verl, tinker); this "
        "project trains with its Megatron-core engine: remove the key",
    ),
    _refused(
        "trainer.trainer_strategy",
        "chooses FSDP or Megatron in Trinity; the engine here is Megatron-core",
        accepts=("megatron",),
    ),
    _same("trainer.save_interval"),
    _same("trainer.total_steps", "null trains until the data ends"),
    _same("trainer.save_hf_checkpoint"),
    _same("trainer.max_checkpoints_to_keep", "0 or null keeps all"),
    _alias("trainer.grad_clip", "trainer.optim.grad_clip"),
    _alias("trainer.use_remove_padding", "trainer.sequence_packing"),
    _refused("trainer.use_dynamic_bsz", _TOKEN_BUDGET, accepts=(False,)),
    _refused("trainer.max_token_len_per_gpu", _TOKEN_BUDGET),
    _refused(
        "trainer.ulysses_sequence_parallel_size",
        "splits sequences across ranks "
        "(Ulysses); not implemented here (megatron.sequence_parallel splits activations "
        "under tensor parallelism)",
        accepts=(1,),
    ),
    _same(
        "trainer.enable_preview",
        "the rollout_examples table to MLflow, TensorBoard (Text) and the step's Dagster "
        "materialisation",
    ),
    _alias("trainer.critic_warmup", "critic.warmup_steps", "steps that train only the critic"),
    _refused(
        "trainer.balance_batch",
        "balances sequence lengths across data-parallel ranks; not implemented here",
        accepts=(False,),
    ),
    *(
        _refused(f"trainer.{key}", _FSDP)
        for key in (
            "param_offload",
            "optimizer_offload",
            "grad_offload",
            "offload_policy",
            "fix_actor_microbatch_loss_scale",
        )
    ),
    _refused(
        "trainer.save_strategy",
        "limits Trinity's concurrent checkpoint writers; here "
        "engine rank 0's save thread writes each checkpoint",
    ),
    _converted(
        "trainer.megatron",
        "megatron.tensor_model_parallel_size",
        "tensor/pipeline parallel sizes and sequence_parallel -> megatron.*; other "
        "parallelisms only at 1",
        _trainer_megatron,
    ),
    _refused(
        "trainer.trainer_config",
        "passes verl's own configuration through; the engine here is configured by "
        "trainer.*, critic.*, megatron.* and algorithm.*. Its resume_mode / resume_from_path "
        "do not act in Trinity either (it sets resume_mode from continue_from_checkpoint): a run "
        "here resumes from its own newest checkpoint, and model.model_path can start a run "
        "from another's checkpoints/global_step_N/huggingface",
    ),
    _refused(
        "trainer.trainer_config_path",
        "passes verl's own configuration through; the engine here is configured by "
        "trainer.*, megatron.* and algorithm.*",
    ),
    # synchronizer
    _same("synchronizer.sync_method", "any case; `online` = nccl, `offline` = checkpoint"),
    _same(
        "synchronizer.sync_style",
        "fixed, explorer_driven, trainer_driven, fully_async, in any case; "
        "`dynamic_by_explorer` / `dynamic_by_trainer` = the driven ones",
    ),
    _same("synchronizer.sync_interval"),
    _same("synchronizer.sync_offset"),
    _same("synchronizer.sync_timeout"),
    _converted(
        "synchronizer.trainer_sync_interval",
        "synchronizer.sync_interval",
        "accepted when equal to sync_interval (one interval for both sides here)",
        _interval("trainer"),
    ),
    _converted(
        "synchronizer.explorer_sync_interval",
        "synchronizer.sync_interval",
        "accepted when equal to sync_interval",
        _interval("explorer"),
    ),
    _refused(
        "synchronizer.group_name",
        "names Trinity's NCCL group; the weight-sync group here "
        "is created per transfer from the engine's state file: remove the key",
    ),
    _refused("synchronizer.wait_for_checkpoint", "is not read by Trinity either: remove it"),
    # monitor
    _converted(
        "monitor.monitor_type",
        "monitor.backends",
        "`tensorboard`, `mlflow`, `wandb` -> that one backend",
        _monitor_type,
    ),
    _converted(
        "monitor.monitor_args",
        "monitor.mlflow_tracking_uri",
        "mlflow: `uri`; wandb: `base_url`; credentials only from the environment",
        _monitor_args,
    ),
    _refused(
        "monitor.detailed_stats",
        "adds std/max/min to Trinity's evaluation metrics; "
        "the evaluation here records accuracy with its interval",
    ),
    _refused("monitor.enable_ray_timeline", "writes Ray's timeline; there is no Ray here"),
)

_BY_PATH = {key.path: key for key in TRINITY_KEYS}


def translate(data: dict[str, Any], *, default_repeat_times: int) -> dict[str, Any]:
    """`data` with Trinity-RFT's keys moved to this project's; raises `TrinityKeyError` with
    one line per key that cannot act here (`key path: why, what to use`).

    `default_repeat_times` is `algorithm.repeat_times` when `data` does not set it (Trinity's
    `buffer.train_batch_size` 0 is derived from it)."""
    out = copy.deepcopy(data)
    moved: dict[str, tuple[str, Any]] = {}  # our key -> (Trinity key, value)
    refused: list[str] = []
    for path, value in list(_trinity_entries(data)):
        key = _BY_PATH[path]
        _remove(out, path)
        if key.kind == "refused":
            if not any(type(value) is type(a) and value == a for a in key.accepts):
                refused.append(f"{path}: {key.note}")
            continue
        try:
            produced = key.convert(value, data) if key.convert else {str(key.ours): value}
        except (TypeError, ValueError) as err:
            refused.append(f"{path}: {err}")
            continue
        for ours, new in produced.items():
            if _dotted(data, ours, _MISSING) is not _MISSING:
                refused.append(f"{path}: given together with {ours}, its key here; keep one")
            elif ours in moved and moved[ours][1] != new:
                refused.append(f"{path}: sets {ours} as {moved[ours][0]} does; keep one")
            else:
                moved[ours] = (path, new)
    if refused:
        raise TrinityKeyError(refused)
    for ours, (_, value) in moved.items():
        set_dotted(out, ours, value)
    _derive_train_batch_size(out, data, default_repeat_times)
    return out


def _trinity_entries(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of each of Trinity's keys in `data`; a `same` key's subtree is Trinity's."""
    for name, value in data.items():
        path = f"{prefix}{name}"
        key = _BY_PATH.get(path)
        if key is not None and key.kind != "same":
            yield path, value
        elif isinstance(value, Mapping):
            yield from _trinity_entries(value, f"{path}.")


def _derive_train_batch_size(
    out: dict[str, Any], data: Mapping[str, Any], default_repeat_times: int
) -> None:
    """Trinity's `buffer.train_batch_size` 0 (or absent) means batch_size x repeat_times."""
    tasks = _dotted(data, "buffer.batch_size")
    given = _dotted(data, "buffer.train_batch_size")
    if tasks is None or given not in (None, 0):
        return
    repeat = _dotted(out, "algorithm.repeat_times", default_repeat_times)
    set_dotted(out, "buffer.train_batch_size", int(tasks) * int(repeat))


_MISSING = object()


def _remove(data: dict[str, Any], path: str) -> None:
    *parents, leaf = path.split(".")
    chain = [data]
    for part in parents:
        chain.append(chain[-1][part])
    del chain[-1][leaf]
    for node, part in zip(reversed(chain[:-1]), reversed(parents), strict=True):
        if node[part]:
            break
        del node[part]  # a section left empty by moving its keys out


def set_dotted(data: dict[str, Any], path: str, value: Any) -> None:
    """Set `data[a][b][c] = value` for the path `a.b.c`, making the sections it lacks."""
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def trinity_names(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved configuration (this project's keys) with each renamed key under Trinity's
    name; it loads back unchanged."""
    out = copy.deepcopy(resolved)
    for key in TRINITY_KEYS:
        if key.kind != "alias" or key.ours is None:
            continue
        value = _dotted(out, key.ours, _MISSING)
        if value is _MISSING:
            continue
        _remove(out, key.ours)
        set_dotted(out, key.path, value)
    return out
