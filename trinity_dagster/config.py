"""Typed run configuration, loaded from YAML, with Trinity-RFT's field names where one exists.

Every section defaults to the embedded demo: a tiny Llama-style model trained on CPU with
everything under one run root directory. Unknown keys, keys given twice, wrong types and
impossible combinations raise `ConfigError`, whose message names the file and the key path;
`check_inputs` refuses input files and directories that do not exist.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trinity_dagster.algorithm_names import (
    AdvantageFn,
    CriticAdvantageFn,
    KlFn,
    LossAggMode,
    PolicyLossFn,
)
from trinity_dagster.paths import SHM_ROOT, delta_unaddressable, local_path, uri_scheme
from trinity_dagster.tasks import TASKSETS
from trinity_dagster.trinity_keys import TrinityKeyError, set_dotted, translate

DEFAULT_RUN_ROOT = "runs/demo"
CONFIG_ENV_VAR = "TRINITY_DAGSTER_CONFIG"  # the YAML file the code location loads
DAGSTER_SENSOR_LOOP_S = 5  # the sensor daemon's loop (dagster/_daemon/sensor.py)


def is_loopback_host(host: str) -> bool:
    """Whether `host` reaches this machine only: `localhost` or a loopback IP address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the file and key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelConfig(_Section):
    """The policy model: a local Hugging Face directory, or a tiny Llama-style model built here."""

    path: str | None = Field(
        default=None,
        description="Local HF Llama/Qwen2 directory to start from; None builds the tiny model.",
    )
    vocab_size: int | None = Field(
        default=None, ge=2, description="None: taken from the tokenizer of the task set."
    )
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_query_groups: int = Field(default=2, ge=1, description="Key/value heads (GQA).")
    ffn_hidden_size: int = Field(default=352, ge=8)
    max_position_embeddings: int = Field(default=64, ge=8)
    rope_theta: float = Field(default=10000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = Field(
        default=False,
        description="Share the input embedding with the output layer (the demo learns its "
        "task sooner untied).",
    )
    max_prompt_tokens: int = Field(default=24, ge=1)
    max_response_tokens: int = Field(default=8, ge=1)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + response) the trainer accepts."""
        return self.max_prompt_tokens + self.max_response_tokens

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.path is None and self.max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_prompt_tokens + max_response_tokens ({self.max_model_len}) exceeds "
                f"max_position_embeddings ({self.max_position_embeddings})"
            )
        return self


# Trinity-RFT's PPO-style loss defaults: symmetric clip 0.2, dual-clip c = 3 on negative
# advantages, and a k2 KL loss against the reference model with coefficient 0.001.
_TRINITY_PPO_LOSS: dict[str, Any] = {
    "policy_loss_fn": "ppo",
    "clip_range_low": 0.2,
    "clip_range_high": 0.2,
    "dual_clip": 3.0,
    "kl_loss_fn": "k2",
    "kl_loss_coef": 0.001,
}

# The AlgorithmConfig keys a named `algorithm_type` selects: Trinity-RFT's `default_config()`
# of that algorithm and the default arguments of its functions (docs/trinity.md). Keys the
# file sets override them; without `algorithm_type` the field defaults (the demo's) apply.
ALGORITHM_PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {"advantage_fn": "ppo", "repeat_times": 1, **_TRINITY_PPO_LOSS},
    "grpo": {"advantage_fn": "grpo", **_TRINITY_PPO_LOSS},
    "rloo": {"advantage_fn": "rloo", **_TRINITY_PPO_LOSS},
    "reinforce_plus_plus": {"advantage_fn": "reinforce_plus_plus", **_TRINITY_PPO_LOSS},
    "opmd": {"advantage_fn": "opmd", **_TRINITY_PPO_LOSS},
    "gspo": {
        "advantage_fn": "grpo",
        "policy_loss_fn": "gspo",
        "clip_range_low": 3e-4,
        "clip_range_high": 4e-4,
        "loss_agg_mode": "seq-mean-token-mean",
        "kl_loss_fn": "k2",
        "kl_loss_coef": 0.001,
    },
    "sft": {"policy_loss_fn": "sft", "kl_loss_fn": "none"},
}

# Trinity-RFT's names of algorithms this project has under another name.
ALGORITHM_ALIASES = {"reinforceplusplus": "reinforce_plus_plus"}


class AlgorithmConfig(_Section):
    """The RL algorithm: advantage, policy loss, KL and loss aggregation, chosen by name.

    A named `algorithm_type` fills the keys the file leaves out from its ALGORITHM_PRESETS
    entry (Trinity-RFT's defaults); without one, the field defaults are the demo's GRPO.
    """

    algorithm_type: str = Field(
        default="grpo",
        description="Selects the defaults of the keys in ALGORITHM_PRESETS when given: "
        "one of its names.",
    )
    repeat_times: int = Field(default=8, ge=1, description="Responses per task (GRPO group size).")
    advantage_fn: AdvantageFn | CriticAdvantageFn = Field(
        default="grpo", description="'ppo': GAE with a critic (the `critic` section)."
    )
    advantage_epsilon: float = Field(default=1e-6, gt=0)
    gamma: float = Field(
        default=1.0, ge=0, le=1, description="Discount of GAE and of reinforce_plus_plus returns."
    )
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda (advantage_fn 'ppo').")
    opmd_baseline: Literal["mean", "logavgexp"] = Field(
        default="mean", description="Group baseline of the opmd advantage."
    )
    opmd_tau: float = Field(
        default=1.0, gt=0, description="Temperature of the opmd 'logavgexp' baseline."
    )
    policy_loss_fn: PolicyLossFn = "ppo"
    clip_range_low: float = Field(default=0.2, ge=0, lt=1)
    clip_range_high: float = Field(default=0.28, ge=0)
    dual_clip: float | None = Field(
        default=None, gt=1, description="Dual-clip constant c (> 1); None disables it."
    )
    kl_loss_fn: KlFn = "none"
    kl_loss_coef: float = Field(default=0.0, ge=0)
    kl_penalty_fn: KlFn = "none"
    kl_penalty_coef: float = Field(default=0.0, ge=0)
    kl_bound: float = Field(
        default=1.0, gt=0, description="Largest actor/ppo_kl the kl_within_bound check accepts."
    )
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coef: float = Field(default=0.0, ge=0)
    recompute_old_logprobs: bool = Field(
        default=False, description="Recompute old log-probs with the trainer's weights."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """The keys given, completed from the preset of their `algorithm_type` when named."""
        if not isinstance(data, dict) or "algorithm_type" not in data:
            return data
        name = data["algorithm_type"]
        if isinstance(name, str):
            name = ALGORITHM_ALIASES.get(name.lower(), name.lower())
        preset = ALGORITHM_PRESETS.get(name, {}) if isinstance(name, str) else {}
        return {**preset, **data, "algorithm_type": name}

    @field_validator("algorithm_type")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        """The names of ALGORITHM_PRESETS are the algorithms there are."""
        if value not in ALGORITHM_PRESETS:
            *rest, last = (repr(name) for name in ALGORITHM_PRESETS)
            raise ValueError(f"Input should be {', '.join(rest)} or {last}")
        return value

    @field_validator("advantage_fn", mode="before")
    @classmethod
    def _advantage_alias(cls, value: object) -> object:
        """Trinity-RFT spells reinforce_plus_plus `reinforceplusplus`."""
        return ALGORITHM_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _critic_settings_fit(self) -> AlgorithmConfig:
        if self.algorithm_type == "ppo" and not self.uses_critic:
            raise _at(
                "algorithm.advantage_fn",
                f"{self.advantage_fn!r}: algorithm_type 'ppo' trains a critic to estimate "
                "advantages by GAE, advantage_fn 'ppo'; pick another algorithm_type for "
                "critic-free advantages",
            )
        if self.lam != type(self).model_fields["lam"].default and not self.uses_critic:
            raise _at(
                "algorithm.lam",
                f"GAE's lambda acts only with advantage_fn 'ppo', not {self.advantage_fn!r}",
            )
        return self

    @property
    def uses_critic(self) -> bool:
        """True when advantages come from a value model trained beside the actor (GAE)."""
        return self.advantage_fn == "ppo"

    @property
    def uses_reference_model(self) -> bool:
        """True when a frozen reference model is needed for a KL term."""
        return (self.kl_loss_fn != "none" and self.kl_loss_coef > 0) or (
            self.kl_penalty_fn != "none" and self.kl_penalty_coef > 0
        )


class BufferConfig(_Section):
    """The experience buffer: where its Delta tables live and how batches are sampled."""

    tables_root: str | None = Field(
        default=None,
        min_length=1,
        description="Where the Delta tables experiences/, batches/ and quarantine/ live: a "
        "directory or a file:// URI; None: the run root.",
    )
    train_batch_size: int = Field(default=256, ge=1, description="Experiences per train step.")
    batch_unit: Literal["rows", "groups"] = Field(
        default="groups", description="Pin whole GRPO groups, or single rows."
    )
    sample_strategy: Literal["fifo", "staleness_control", "priority"] = "fifo"
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="For staleness_control: the most weights versions a row may lag behind; "
        "None: no limit (Trinity-RFT's default).",
    )
    reuse_limit: int = Field(default=1, ge=1, description="For priority: uses per experience.")
    writer_max_retries: int = Field(default=20, ge=0)
    total_epochs: int | None = Field(
        default=None,
        ge=1,
        description="Passes of the built-in explorer over its task set; None: no end.",
    )
    read_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="The trainer stops (data ended) after waiting this long for a batch with "
        "no new experience arriving.",
    )
    capacity: int | None = Field(
        default=None,
        ge=1,
        description="Most unconsumed experiences (written, not yet trained on as often as the "
        "sampler allows, nor dropped) the buffer holds: the built-in explorer waits for room "
        "before it generates a step (Trinity-RFT's experience_buffer.capacity). It bounds how "
        "far explorers that never wait for weights (sync_style fully_async, trainer_driven "
        "with nccl) run ahead. None: no bound.",
    )

    @model_validator(mode="after")
    def _tables_on_a_file_system(self) -> BufferConfig:
        """A path or a file:// URI; object stores need settings this config does not have."""
        if self.tables_root is not None:
            try:
                local_path(self.tables_root)
            except ValueError:
                raise _at(
                    "buffer.tables_root",
                    f"{self.tables_root!r}: only a directory or a file:// URI is supported; "
                    "object storage (s3://, gs://, az://) also needs storage options and a "
                    "commit lock, which are not configurable yet (see docs/scaling.md)",
                ) from None
        return self


class OptimConfig(_Section):
    """Optimizer and learning-rate schedule of the actor."""

    optimizer: Literal["adam", "adamw"] = "adamw"
    lr: float = Field(default=5e-5, gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping.")


CRITIC_LR = 1e-5  # verl's critic learning rate


class CriticConfig(_Section):
    """PPO's value model, trained beside the actor when `algorithm.advantage_fn` is 'ppo'."""

    model_path: str | None = Field(
        default=None,
        description="Local HF directory the critic starts from: a causal LM (its backbone; "
        "a new value head) or a token-classification model with one label (backbone and "
        "head); None: the actor's starting weights and a new value head.",
    )
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=CRITIC_LR),
        description=f"The critic's optimizer and schedule; lr defaults to {CRITIC_LR} (verl's).",
    )
    cliprange_value: float = Field(
        default=0.5, gt=0, description="How far a value prediction may move from the old one."
    )
    loss_agg_mode: LossAggMode = "token-mean"
    warmup_steps: int = Field(
        default=0, ge=0, description="The first steps train only the critic, not the actor."
    )

    @field_validator("optim", mode="before")
    @classmethod
    def _critic_lr(cls, value: Any) -> Any:
        """An `optim` section without `lr` gets the critic's default, not the actor's."""
        if isinstance(value, dict) and "lr" not in value:
            return {**value, "lr": CRITIC_LR}
        return value


class TrainerConfig(_Section):
    """The training loop: steps, checkpoints, micro-batching, seed."""

    total_steps: int | None = Field(
        default=450,
        ge=1,
        description="None: train until the data ends (an explorer marks its end, or nothing "
        "new arrives for buffer.read_timeout_s), as Trinity-RFT does.",
    )
    save_interval: int = Field(default=100, ge=0, description="0: only the final save.")
    save_hf_checkpoint: Literal["always", "last", "never"] = "last"
    max_checkpoints_to_keep: int | None = Field(
        default=3, ge=1, description="None (or 0, as in Trinity-RFT) keeps all."
    )
    micro_batch_size: int = Field(
        default=128,
        ge=1,
        description="Rows per forward/backward pass; a per-rank batch of fewer rows is one "
        "micro-batch.",
    )
    sequence_packing: bool = Field(
        default=False,
        description=(
            "Train each micro-batch's rows packed back to back without padding (verl's "
            "use_remove_padding): same loss, no compute on padding."
        ),
    )
    seed: int = 42
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads of each engine rank's torch. None: its machine's cores shared "
        "by the ranks on it, less the built-in explorer's threads when that generates beside "
        "training on the same machine (see explorer.torch_threads).",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sft_warmup_steps: int = Field(
        default=175, ge=0, description="Steps of SFT on demonstrations before RL (demo)."
    )
    sft_lr: float | None = Field(
        default=1e-3,
        gt=0,
        description="Learning rate of the SFT warm-up steps; None: the schedule's (optim.lr).",
    )
    enable_preview: bool = Field(
        default=True,
        description="Log the table rollout_examples (each step's lowest- and highest-reward "
        "experience as text) every synchronizer.sync_interval steps, as Trinity-RFT does.",
    )

    @field_validator("max_checkpoints_to_keep", mode="before")
    @classmethod
    def _zero_keeps_all(cls, value: object) -> object:
        """Trinity-RFT writes "keep all" as 0 (or a negative number)."""
        return None if isinstance(value, int) and value <= 0 else value


# Trinity-RFT's sync styles (docs/checkpoints.md): when the trainer publishes and when
# explorers take new weights.
class SyncMethod(StrEnum):
    """How trained weights reach explorers."""

    CHECKPOINT = "checkpoint"  # safetensors files under weights/
    MEMORY = "memory"  # a region in /dev/shm on engine rank 0's machine
    NCCL = "nccl"  # a collective transfer from engine rank 0 (gloo on CPU)


class SyncStyle(StrEnum):
    """When explorers get new weights (Trinity-RFT's sync styles)."""

    FIXED = "fixed"  # every sync_interval steps
    EXPLORER_DRIVEN = "explorer_driven"  # when an explorer asks
    TRAINER_DRIVEN = "trainer_driven"  # when the trainer decides
    FULLY_ASYNC = "fully_async"  # explorers never wait for weights


class SynchronizerConfig(_Section):
    """How and when trained weights reach the explorers."""

    sync_method: SyncMethod = SyncMethod.CHECKPOINT
    sync_style: SyncStyle = SyncStyle.FIXED
    sync_interval: int = Field(default=1, ge=1)
    sync_offset: int = Field(default=0, ge=0, description="Explore steps explorers run ahead.")
    sync_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds an explorer waits for the weights it needs before it fails.",
    )
    keep_synced_weights: int = Field(default=2, ge=1, description="Sync-only weight dirs kept.")

    @field_validator("sync_method", mode="before")
    @classmethod
    def _method_any_case(cls, value: object) -> object:
        """Trinity writes the method in any case (`NCCL`, `Checkpoint`), or by its aliases."""
        if not isinstance(value, str):
            return value
        value = {"online": "nccl", "offline": "checkpoint"}.get(value.lower(), value.lower())
        if value == "hccl":
            raise ValueError(
                "'hccl' syncs over Ascend NPUs' collective library, which this engine does not "
                "run on; use 'nccl' (gloo on CPU)"
            )
        return value

    @field_validator("sync_style", mode="before")
    @classmethod
    def _style_by_trinitys_names(cls, value: object) -> object:
        """Trinity's styles and their aliases, in any case."""
        if not isinstance(value, str):
            return value
        aliases = {"dynamic_by_explorer": "explorer_driven", "dynamic_by_trainer": "trainer_driven"}
        return aliases.get(value.lower(), value.lower())

    @model_validator(mode="after")
    def _offset_bounds_waiting_explorers(self) -> SynchronizerConfig:
        if self.sync_style is SyncStyle.FULLY_ASYNC and self.sync_offset:
            raise _at(
                "synchronizer.sync_offset",
                f"{self.sync_offset}: sync_offset bounds how far explorers run ahead of the "
                "weights they wait for; under sync_style fully_async they never wait, so it "
                "has nothing to bound: remove it",
            )
        return self


class MegatronConfig(_Section):
    """Megatron-core parallelism and implementation choices."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    params_dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def world_size(self) -> int:
        """Ranks the engine service is launched with."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.data_parallel_size
        )


class ExplorerConfig(_Section):
    """The built-in explorer: task source, reward, sampling and evaluation."""

    taskset: str = Field(
        default="two_digit_addition", description="A registered task set, or a JSONL path."
    )
    eval_taskset: str = Field(default="two_digit_addition_eval")
    reward_fn: str = Field(default="exact_match")
    tasks_per_step: int = Field(default=32, ge=1)
    step_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="An explore step (generation, rewards, writing) that takes longer counts "
        "as hung: rft_loop_sensor ends the explorer's run, which starts again from that step.",
    )
    eval_tasks: int = Field(default=500, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Nucleus sampling of rollouts: only the most likely tokens that make up "
        "this share of the probability are drawn.",
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads of the built-in explorer's torch. None: all cores but one when "
        "it only runs while training waits (sync_style fixed, sync_interval 1, sync_offset 0), "
        "leaving one to the trainer's bookkeeping beside it, else half of them, leaving the "
        "rest to the engine it runs beside (at least one).",
    )
    seed: int = 0


class ServiceConfig(_Section):
    """The persistent trainer engine service, its control API and its launch on N nodes."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    allow_non_loopback: bool = False
    idle_timeout_s: float = Field(
        default=1800.0, gt=0, description="The service stops after this long without commands."
    )
    orphan_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Once the Dagster deployment that started the service or last attached to "
        "it (`dagster dev`, `dagster-daemon run`, `trinity-dagster run`) has exited, the "
        "service stops after this long without commands, if that is sooner than "
        "idle_timeout_s; a deployment restarted within it finds the service warm. A service "
        "started by `trinity-dagster engine start` has no owner until one attaches.",
    )
    start_timeout_s: float = Field(default=300.0, gt=0)
    request_timeout_s: float = Field(default=1800.0, gt=0)
    progress_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A train step that goes this long without a layer's forward, a gradient "
        "or an optimizer step counts as hung: its service is killed and the step repeated.",
    )
    nnodes: int = Field(default=1, ge=1, description="Machines the engine service runs on.")
    nproc_per_node: int | None = Field(
        default=None, ge=1, description="Ranks on each node; None: the world size / nnodes."
    )
    node_rank: int | None = Field(
        default=None,
        ge=0,
        description="This node's index (0..nnodes-1); node 0 hosts the rendezvous store. The "
        "c10d rendezvous assigns the process ranks, so rank 0 may land on any node. None: the "
        "node that the endpoint names hosts it.",
    )
    rdzv_endpoint: str | None = Field(
        default=None, description="host:port of the c10d rendezvous; required when nnodes > 1."
    )

    @model_validator(mode="after")
    def _check_rendezvous(self) -> ServiceConfig:
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise _at(
                "service.node_rank",
                f"{self.node_rank} is not below service.nnodes ({self.nnodes})",
            )
        if self.rdzv_endpoint is None:
            if self.nnodes > 1:
                raise _at(
                    "service.rdzv_endpoint",
                    f"required when service.nnodes > 1 ({self.nnodes}): host:port of the node "
                    "that hosts the rendezvous",
                )
            return self
        host, _ = self.rdzv_address
        if not (is_loopback_host(host) or self.allow_non_loopback):
            raise _at(
                "service.rdzv_endpoint",
                f"{host!r} is not a loopback address; set service.allow_non_loopback: true to "
                "let the rendezvous listen beyond this machine",
            )
        return self

    @property
    def rdzv_address(self) -> tuple[str, int]:
        """(host, port) of `rdzv_endpoint`."""
        where = urlsplit(f"//{self.rdzv_endpoint}")
        try:
            port = where.port
        except ValueError:
            port = None
        if not where.hostname or not port:
            raise _at(
                "service.rdzv_endpoint",
                f"{self.rdzv_endpoint!r} is not host:port with a port in 1..65535",
            )
        return where.hostname, port

    def procs_per_node(self, world_size: int) -> int:
        """Ranks each node starts for an engine of `world_size` ranks."""
        return self.nproc_per_node or world_size // self.nnodes


class DagsterConfig(_Section):
    """How the Dagster graph behaves: sensors, schedules, concurrency."""

    sensors_running: bool = Field(default=True, description="Sensors start running by default.")
    builtin_explorer: bool = Field(
        default=True, description="The explorer sensor runs the built-in explorer loop."
    )
    sensor_interval_s: int = Field(
        default=DAGSTER_SENSOR_LOOP_S,
        description=f"Seconds between sensor evaluations; at least {DAGSTER_SENSOR_LOOP_S}.",
    )
    schedules_running: bool = False
    maintenance_cron: str = "0 * * * *"
    vacuum_retention_hours: int = Field(
        default=168,
        ge=0,
        description=(
            "Delta vacuum deletes unreferenced files older than this many whole hours (Delta "
            "takes whole hours, so e.g. 1.5 is refused). It overrides Delta's own 168-hour "
            "minimum: keep it longer than the longest read of an old snapshot; 0 only while no "
            "writer runs."
        ),
    )
    eval_cron: str = "*/30 * * * *"
    postgres_url: str | None = Field(
        default=None,
        description="`trinity-dagster run`/`demo` keep the Dagster instance (runs, events, "
        "schedules) in this PostgreSQL database, a SQLAlchemy URL such as "
        "postgresql://user@host:5432/db (password from PGPASSWORD or ~/.pgpass, or "
        "${oc.env:...}); one database per run root. None: SQLite under "
        "run_root/dagster_home.",
    )
    steps_per_run: int = Field(
        default=1000,
        ge=1,
        description="Steps one trainer (and built-in explorer) run covers: the sensor adds "
        "their partitions when it launches the run and starts the next run when one ends, "
        "so a launch costs the same at step 50,000 as at step 1.",
    )
    maintenance_every_steps: int | None = Field(
        default=500,
        ge=1,
        description="While training, the sensor launches delta_maintenance_job every this "
        "many steps (ledger update, compaction, log clean-up), so Delta opens and commits "
        "stay as fast at step 50,000 as at step 1. None: only on the maintenance schedule.",
    )

    @field_validator("postgres_url")
    @classmethod
    def _a_postgres_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgresql+")):
            raise ValueError(f"{value!r} is not a postgresql:// URL")
        return value

    @field_validator("sensor_interval_s")
    @classmethod
    def _not_below_the_sensor_loop(cls, value: int) -> int:
        if value < DAGSTER_SENSOR_LOOP_S:
            raise ValueError(
                f"must be at least {DAGSTER_SENSOR_LOOP_S}: Dagster's sensor daemon evaluates "
                f"sensors at most every {DAGSTER_SENSOR_LOOP_S} s, so a shorter interval has "
                "no effect"
            )
        return value


MonitorBackend = Literal["tensorboard", "mlflow", "jsonl", "wandb"]


class MonitorConfig(_Section):
    """Logging, and the experiment-tracking backends that receive every step's metrics."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    backends: list[MonitorBackend] = Field(
        default=["tensorboard", "jsonl"],
        description="Where the trainer also sends each step's metrics: 'tensorboard' "
        "(logs/tensorboard/), 'mlflow' (logs/mlflow/, or mlflow_tracking_uri), 'jsonl' "
        "(logs/metrics.jsonl), 'wandb' (logs/wandb/, or a W&B server).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking store or server; None: SQLite under logs/mlflow/.",
    )
    wandb_mode: Literal["offline", "online"] | None = Field(
        default=None,
        description="'offline' keeps W&B runs under logs/wandb/ (upload later with `wandb "
        "sync`); 'online' sends them to wandb_base_url, with WANDB_API_KEY from the "
        "environment. None: the environment's WANDB_MODE, else 'offline'.",
    )
    wandb_base_url: str | None = Field(
        default=None, description="The W&B server of 'online' runs; None: W&B's default."
    )

    @model_validator(mode="after")
    def _check_backends_once(self) -> MonitorConfig:
        repeated = sorted({b for b in self.backends if self.backends.count(b) > 1})
        if repeated:
            raise _at("monitor.backends", f"{', '.join(repeated)} listed more than once")
        return self


class TrinityConfig(_Section):
    """The whole run configuration."""

    project: str = "trinity-dagster"
    name: str = "demo"
    run_root: str = Field(default=DEFAULT_RUN_ROOT, description="Everything of a run lives here.")
    continue_from_checkpoint: bool = Field(
        default=True,
        description="False: when run_root holds a run already, `trinity-dagster run` trains "
        "fresh in run_root_<YYYYmmddHHMMSS> under the name name_<YYYYmmddHHMMSS>, as "
        "Trinity-RFT does; true resumes the run there.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    dagster: DagsterConfig = Field(default_factory=DagsterConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @model_validator(mode="after")
    def _sft_type_trains_every_step(self) -> TrinityConfig:
        """algorithm_type 'sft': all steps imitate demonstrations unless the file says otherwise."""
        trainer = self.trainer
        if (
            self.algorithm.algorithm_type == "sft"
            and "sft_warmup_steps" not in trainer.model_fields_set
        ):
            if trainer.total_steps is None:
                raise _at(
                    "trainer.sft_warmup_steps",
                    "algorithm_type 'sft' trains sft_warmup_steps steps of demonstrations; "
                    "set it, or trainer.total_steps",
                )
            trainer.sft_warmup_steps = trainer.total_steps
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> TrinityConfig:
        tp = self.megatron.tensor_model_parallel_size
        for field in ("num_attention_heads", "num_query_groups"):
            if getattr(self.model, field) % tp:
                raise _at(
                    "megatron.tensor_model_parallel_size",
                    f"{tp} does not divide model.{field} ({getattr(self.model, field)})",
                )
        if self.buffer.batch_unit == "groups" and (
            self.buffer.train_batch_size % self.algorithm.repeat_times
        ):
            raise _at(
                "buffer.train_batch_size",
                f"{self.buffer.train_batch_size} is not a multiple of algorithm.repeat_times "
                f"({self.algorithm.repeat_times}) while buffer.batch_unit is 'groups'",
            )
        per_rank, rest = divmod(self.buffer.train_batch_size, self.megatron.data_parallel_size)
        micro = self.trainer.micro_batch_size
        if rest or (micro < per_rank and per_rank % micro):
            raise _at(
                "trainer.micro_batch_size",
                f"{self.trainer.micro_batch_size} does not divide the per-rank batch "
                f"(buffer.train_batch_size {self.buffer.train_batch_size} / "
                f"megatron.data_parallel_size {self.megatron.data_parallel_size})",
            )
        if self.megatron.pipeline_model_parallel_size > 1:
            raise _at(
                "megatron.pipeline_model_parallel_size",
                f"{self.megatron.pipeline_model_parallel_size}: the train engine has no "
                "pipeline schedule yet (only HF import and export run under pipeline "
                "parallelism); use tensor_model_parallel_size or data_parallel_size",
            )
        self._check_critic()
        self._check_capacity()
        if self.trainer.sequence_packing and self.megatron.sequence_parallel:
            raise _at(
                "trainer.sequence_packing",
                "packed sequences cannot be split across tensor-parallel ranks; set "
                "megatron.sequence_parallel false or trainer.sequence_packing false",
            )
        if self.trainer.total_steps is None and self.trainer.optim.lr_scheduler == "cosine":
            raise _at(
                "trainer.optim.lr_scheduler",
                "'cosine' decays to min_lr at trainer.total_steps, which is unset (train until "
                "the data ends); use 'constant' or set trainer.total_steps",
            )
        if self.synchronizer.sync_method is SyncMethod.MEMORY and self.service.nnodes > 1:
            raise _at(
                "synchronizer.sync_method",
                f"'memory' needs the explorer on the machine of engine rank 0, but with "
                f"service.nnodes {self.service.nnodes} rank 0 may land on any node; "
                "use 'checkpoint' to reach explorers on other machines",
            )
        self._check_service_layout()
        if not (is_loopback_host(self.service.host) or self.service.allow_non_loopback):
            raise _at(
                "service.host",
                f"{self.service.host!r} is not a loopback address; set "
                "service.allow_non_loopback: true to expose the control API",
            )
        return self

    def _check_capacity(self) -> None:
        """A capacity that always leaves the trainer a batch and the explorer room for a
        step: below it, the trainer could wait for rows while the explorer waits for room."""
        capacity = self.buffer.capacity
        if capacity is None:
            return
        batch = self.buffer.train_batch_size
        kinds = (False, True) if self.trainer.sft_warmup_steps else (False,)
        step_rows = max(self.explore_step_rows(demonstrations=kind) for kind in kinds)
        least = batch + step_rows - 1
        if capacity < least:
            raise _at(
                "buffer.capacity",
                f"{capacity} is too small: the trainer waits for {batch} unconsumed "
                f"experiences (buffer.train_batch_size) while the built-in explorer waits "
                f"for room for its {step_rows} (a step's rows); at least {least}",
            )

    def explore_step_rows(self, *, demonstrations: bool) -> int:
        """The rows a built-in explorer step writes: a batch of demonstrations
        (`buffer.train_batch_size`), or its tasks times `algorithm.repeat_times`."""
        if demonstrations:
            return self.buffer.train_batch_size
        return self.explorer.tasks_per_step * self.algorithm.repeat_times

    def _check_critic(self) -> None:
        """The `critic` section acts only for a critic algorithm, which needs a whole sequence
        per tensor-parallel rank."""
        if not self.algorithm.uses_critic:
            if self.critic != CriticConfig():
                raise _at(
                    "critic",
                    f"configures PPO's value model, which advantage_fn "
                    f"{self.algorithm.advantage_fn!r} does not train; remove it or use "
                    "algorithm_type 'ppo'",
                )
            return
        if self.megatron.sequence_parallel:
            raise _at(
                "megatron.sequence_parallel",
                "the critic's value head reads whole sequences on every tensor-parallel "
                "rank; set it false for algorithm_type 'ppo'",
            )

    def _check_service_layout(self) -> None:
        """The service's nodes x ranks per node must be the engine's world size."""
        service, megatron = self.service, self.megatron
        world = megatron.world_size
        if service.nnodes * service.procs_per_node(world) == world:
            return
        world_text = (
            f"the world size megatron.tensor_model_parallel_size "
            f"({megatron.tensor_model_parallel_size}) * pipeline_model_parallel_size "
            f"({megatron.pipeline_model_parallel_size}) * data_parallel_size "
            f"({megatron.data_parallel_size}) = {world}"
        )
        if service.nproc_per_node is None:
            raise _at(
                "service.nnodes",
                f"{service.nnodes} nodes cannot share {world_text} evenly",
            )
        raise _at(
            "service.nproc_per_node",
            f"service.nnodes ({service.nnodes}) * service.nproc_per_node "
            f"({service.nproc_per_node}) = {service.nnodes * service.nproc_per_node} does not "
            f"equal {world_text}",
        )

    def resolved_hash(self) -> str:
        """A stable hash of the configuration that training results depend on."""
        relevant = self.model_dump(
            include={"model", "algorithm", "buffer", "trainer", "critic", "megatron"},
            exclude={"buffer": {"tables_root"}},  # where the tables live changes no result
        )
        blob = json.dumps(relevant, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_yaml(self) -> str:
        """The full resolved configuration as YAML."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class _KeyPathError(ValueError):
    """A cross-field problem found after validation, attached to a key path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _at(path: str, message: str) -> _KeyPathError:
    return _KeyPathError(path, message)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"])
        ctx_error = (item.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _KeyPathError):
            lines.append(f"  {ctx_error.path}: {ctx_error.message}")
            continue
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        got = item.get("input")
        suffix = "" if item["type"] in ("extra_forbidden", "missing") else f" (got {got!r})"
        lines.append(f"  {loc or '<root>'}: {message}{suffix}")
    return "\n".join(lines)


def config_from_dict(
    data: dict[str, Any], source: str = "<dict>", base_dir: Path | None = None
) -> TrinityConfig:
    """Validate a configuration mapping.

    Relative paths (`run_root`, `model.path`, `buffer.tables_root` unless it is a URI, JSONL
    task files) resolve against `base_dir`, the config file's directory (default: the working
    directory).
    """
    try:
        repeat_times = AlgorithmConfig.model_fields["repeat_times"].default
        cfg = TrinityConfig.model_validate(translate(data, default_repeat_times=repeat_times))
    except TrinityKeyError as err:
        lines = "\n".join(f"  {line}" for line in err.lines)
        raise ConfigError(f"Trinity-RFT keys in {source} that cannot act here:\n{lines}") from None
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
    base = base_dir or Path.cwd()
    cfg.run_root = _resolve(cfg.run_root, base)
    if cfg.model.path is not None:
        cfg.model.path = _resolve(cfg.model.path, base)
    tables_root = cfg.buffer.tables_root
    if tables_root is not None and uri_scheme(tables_root) is None:
        cfg.buffer.tables_root = _resolve(tables_root, base)
    for field in ("taskset", "eval_taskset"):
        value = getattr(cfg.explorer, field)
        if value.endswith(".jsonl"):
            setattr(cfg.explorer, field, _resolve(value, base))
    _check_table_location(cfg, source)
    return cfg


def _check_table_location(cfg: TrinityConfig, source: str) -> None:
    """Refuse a Delta tables' location Delta Lake cannot address (`paths.delta_unaddressable`)."""
    key, location = (
        ("buffer.tables_root", cfg.buffer.tables_root)
        if cfg.buffer.tables_root
        else (
            "run_root",
            cfg.run_root,
        )
    )
    found = delta_unaddressable(location)
    if found:
        raise ConfigError(
            f"invalid configuration in {source}:\n  {key}: {location!r} contains "
            f"{', '.join(map(repr, found))}, which Delta Lake (deltalake 1.6) cannot address in "
            "a table's path (^ | [ ] \\, control characters, % followed by two hex digits); "
            "choose a directory without them"
        )


def _resolve(path: str, base: Path) -> str:
    """`path` made absolute against `base` (the config file's directory)."""
    resolved = Path(path).expanduser()
    return str((resolved if resolved.is_absolute() else base / resolved).resolve())


def run_root_in_use(config: TrinityConfig) -> bool:
    """Whether the run root holds anything (a run that could be continued)."""
    root = Path(config.run_root)
    return root.is_dir() and any(root.iterdir())


def start_fresh(config: TrinityConfig, now: dt.datetime | None = None) -> TrinityConfig:
    """`continue_from_checkpoint: false` as Trinity-RFT acts on it: when the run root holds a
    run already, a copy of `config` whose `name` and `run_root` end in `_<YYYYmmddHHMMSS>`
    (and which continues from its own checkpoints from then on); otherwise `config`.

    Raises `ConfigError` when the old run's Delta tables live outside its run root
    (`buffer.tables_root`): the fresh run would read its experiences.
    """
    if config.continue_from_checkpoint or not run_root_in_use(config):
        return config
    if config.buffer.tables_root is not None:
        raise ConfigError(
            f"continue_from_checkpoint: false starts a fresh run, but buffer.tables_root "
            f"({config.buffer.tables_root}) holds the tables of the run in {config.run_root}, "
            "which the fresh run would read; point buffer.tables_root at a new directory"
        )
    stamp = (now or dt.datetime.now()).strftime("%Y%m%d%H%M%S")
    return config.model_copy(
        update={
            "name": f"{config.name}_{stamp}",
            "run_root": f"{config.run_root}_{stamp}",
            "continue_from_checkpoint": True,
        }
    )


def check_inputs(config: TrinityConfig) -> None:
    """Refuse a configuration whose inputs do not exist or do not fit this machine: `model.path`
    (and its positions), `critic.model_path`, the task files, and `/dev/shm` for
    `sync_method: memory`.

    The one-line message names each missing input's key path and path. Built-in task sets
    need no file; outputs (`run_root`, `buffer.tables_root`) are created when needed.
    """
    missing = list(_missing_inputs(config))
    if missing:
        raise ConfigError(f"missing input: {'; '.join(missing)}")


def _missing_inputs(config: TrinityConfig) -> Iterator[str]:
    """`key path: problem` of each input file or directory that is not there."""
    model_path = config.model.path
    if model_path is not None and not Path(model_path).is_dir():
        yield f"model.path: no such directory: {model_path}"
    elif model_path is not None and (Path(model_path) / "config.json").is_file():
        hf = json.loads((Path(model_path) / "config.json").read_text())
        positions = hf.get("max_position_embeddings")
        if isinstance(positions, int) and config.model.max_model_len > positions:
            yield (
                f"model.max_prompt_tokens + max_response_tokens ({config.model.max_model_len}) "
                f"exceeds max_position_embeddings ({positions}) of {model_path}/config.json"
            )
    critic_path = config.critic.model_path
    if critic_path is not None and not (Path(critic_path) / "config.json").is_file():
        yield f"critic.model_path: no HF model directory (config.json) at {critic_path}"
    if config.synchronizer.sync_method is SyncMethod.MEMORY and not SHM_ROOT.is_dir():
        yield (
            f"synchronizer.sync_method: 'memory' passes weights through {SHM_ROOT}, which this "
            "machine lacks (Linux only); use 'checkpoint'"
        )
    for field in ("taskset", "eval_taskset"):
        value = getattr(config.explorer, field)
        if value in TASKSETS or Path(value).is_file():
            continue
        if value.endswith(".jsonl"):
            yield f"explorer.{field}: no such task file: {value}"
        else:
            yield (
                f"explorer.{field}: {value!r} is neither a built-in task set "
                f"({', '.join(sorted(TASKSETS))}) nor an existing task file"
            )


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> TrinityConfig:
    """Load a YAML file (None: the embedded demo defaults), apply dotted-key overrides."""
    data: dict[str, Any] = {}
    source = "<embedded defaults>"
    base_dir: Path | None = None
    if path is not None:
        file = Path(path)
        source = str(file)
        if not file.is_file():
            raise ConfigError(f"configuration file not found: {file}")
        try:
            loaded = yaml.load(file.read_text(), Loader=_UniqueKeyLoader)
        except _DuplicateKeyError as err:
            raise ConfigError(f"invalid configuration in {file}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"invalid YAML in {file}: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"invalid configuration in {file}: the top level must be a mapping, "
                f"got {type(loaded).__name__}"
            )
        data = _resolve_interpolations(loaded, file)
        base_dir = file.resolve().parent
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, source, base_dir)


def _resolve_interpolations(data: dict[str, Any], file: Path) -> dict[str, Any]:
    """`data` with OmegaConf interpolations (`${oc.env:NAME,default}`, `${section.key}`)
    resolved, as Trinity-RFT resolves them in its configs."""
    if "${" not in json.dumps(data, default=str):
        return data
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid configuration in {file}: {err}".splitlines()[0]) from None
    assert isinstance(resolved, dict)
    return {str(key): value for key, value in resolved.items()}


class _DuplicateKeyError(ValueError):
    """A mapping of a YAML file gives one key twice; the message names its path and lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a key given twice in one mapping (SafeLoader keeps the last)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Raise `_DuplicateKeyError` for the first key given twice in a mapping under `node`."""
    if id(node) in seen:  # an alias: its anchor's node was checked already
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{index}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            key_path = f"{path}.{key.value}" if path else str(key.value)
            if isinstance(key, yaml.ScalarNode):
                identity, line = (key.tag, key.value), key.start_mark.line + 1
                if identity in first_line:
                    raise _DuplicateKeyError(
                        f"{key_path}: given twice, on lines {first_line[identity]} and {line} "
                        "(YAML would silently keep only the last)"
                    )
                first_line[identity] = line
            _refuse_duplicate_keys(value, key_path, seen)
