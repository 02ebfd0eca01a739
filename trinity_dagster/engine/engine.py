"""`TrainEngine`: the Megatron-core actor that the engine service holds on every rank.

It owns the process groups, the policy model (DDP-wrapped), an optional frozen reference
model, PPO's critic when the algorithm has one, the optimizer and LR scheduler, and trains
one step at a time on the dicts made by `trinity_dagster.buffer.reader.to_tensors`. Every
rank receives the whole batch; each trains on its data-parallel slice, and every rank
returns the same metrics.
"""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from trinity_dagster.algorithms import (
    advantages_from_config,
    apply_kl_penalty,
    mask_counts,
    token_level_rewards,
)
from trinity_dagster.algorithms.value import explained_variance, gae_advantages_and_returns
from trinity_dagster.checkpoint.layout import (
    CRITIC_DESCRIPTION_DIR,
    DIST_DIR,
    MODEL_DESCRIPTION_DIR,
)
from trinity_dagster.config import TrinityConfig
from trinity_dagster.engine import hf_weights
from trinity_dagster.engine.async_save import EngineStateSave, SaveQueue
from trinity_dagster.engine.batch_check import BatchError, check_batch
from trinity_dagster.engine.critic import STATE_KEY as CRITIC_STATE_KEY
from trinity_dagster.engine.critic import Critic
from trinity_dagster.engine.model import build_gpt_model, local_logits, packed_local_logits
from trinity_dagster.engine.optim import has_stepped, prepare_training, run_update
from trinity_dagster.engine.packing import Packing, split_micro_batches
from trinity_dagster.engine.parallel import ParallelInfo, destroy_distributed, init_distributed
from trinity_dagster.engine.state import (
    EngineStateError,
    Layout,
    load_engine_state,
    read_engine_state,
    save_engine_state,
)
from trinity_dagster.engine.train_step import (
    LossSettings,
    micro_batch_loss,
    step_metrics,
    token_logprobs_and_entropy,
)
from trinity_dagster.files import write_text_atomic

MICRO_BATCH_KEYS = ("tokens", "attention_mask", "response_mask", "old_logprobs", "advantages")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def copy_model_description(hf_dir: Path, out_dir: Path) -> None:
    """Copy an HF directory's config and tokenizer files (no weights) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in Path(hf_dir).iterdir():
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES) and "index" not in src.name:
            shutil.copyfile(src, out_dir / src.name)


class StepOrderError(ValueError):
    """`train_step(N)` was called while the engine is not at step N-1."""


class TrainEngine:
    """The trainable actor on this rank; construct it on every rank of the engine service."""

    def __init__(self, config: TrinityConfig, hf_dir: Path, *, load_weights: bool = True) -> None:
        """Initialize distributed state and build the model from the HF directory `hf_dir`.

        `load_weights=False` builds the model from `hf_dir`'s config only, for a state that
        `load_state` restores next (e.g. converting a checkpoint).
        """
        self.config = config
        self.hf_dir = Path(hf_dir)
        config_file = self.hf_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"HF model directory {self.hf_dir} has no config.json")
        self.hf_config: dict[str, Any] = json.loads(config_file.read_text())
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.parallel: ParallelInfo = init_distributed(config.megatron, config.trainer.seed)
        try:
            self._build_models(load_weights)
        except BaseException:
            destroy_distributed()  # a failed build leaves no process groups behind
            raise
        self._async_saves = SaveQueue()
        self.step = 0

    def _build_models(self, load_weights: bool) -> None:
        """The actor with its DDP wrapper, optimizer and schedule, the reference model and
        the critic when the algorithm has them."""
        config = self.config
        np.random.seed(config.trainer.seed)
        dtype = config.megatron.params_dtype
        self._gpt: GPTModel = build_gpt_model(self.hf_config, config.megatron, params_dtype=dtype)
        if load_weights:
            hf_weights.load_hf_into_model(self._gpt, self.hf_dir)
        self.model, self.optimizer, self.scheduler = prepare_training(
            self._gpt, config.trainer.optim, config.megatron, config.trainer.total_steps
        )
        self.reference: GPTModel | None = None
        if config.algorithm.uses_reference_model:
            self.reference = build_gpt_model(self.hf_config, config.megatron, params_dtype=dtype)
            hf_weights.load_hf_into_model(self.reference, self.hf_dir)
            self.reference.eval().requires_grad_(False)
        self.critic: Critic | None = None
        if config.algorithm.uses_critic:
            source = Path(config.critic.model_path) if config.critic.model_path else self.hf_dir
            self.critic = Critic(
                config,
                self.parallel,
                source,
                vocab_size=self.hf_config["vocab_size"],
                load_weights=load_weights,
            )

    # -- training -------------------------------------------------------------------------

    def train_step(self, step: int, batch: dict[str, Tensor]) -> dict[str, float]:
        """Train step `step` (must be `self.step + 1`) on `batch`; the step's metrics.

        Raises `StepOrderError` for a step out of order and `BatchError` for a bad batch,
        both before any weight changes.
        """
        started = time.perf_counter()
        if step != self.step + 1:
            raise StepOrderError(
                f"train_step({step}) refused: the engine is at step {self.step}, so the next "
                f"step must be {self.step + 1}"
            )
        check_batch(
            batch,
            max_model_len=self.config.model.max_model_len,
            vocab_size=self.hf_config["vocab_size"],
            data_parallel_size=self.parallel.dp_size,
        )
        algo = self.config.algorithm
        device = self.parallel.device
        batch = {key: value.to(device) for key, value in batch.items() if value is not None}
        local = self._local_slice(batch)
        if algo.recompute_old_logprobs:
            local["old_logprobs"] = self._logprobs(self._gpt, local)
        if self.reference is not None:
            local["ref_logprobs"] = self._logprobs(self.reference, local)
        num_tokens, num_seqs = mask_counts(batch["response_mask"])
        sft_steps = self.config.trainer.sft_warmup_steps
        if self.critic is not None and step == sft_steps + 1 and sft_steps > 0:
            self._start_critic_from_actor()
        advantages, extra = self._advantages(step, batch, local, num_tokens, num_seqs)
        local["advantages"] = self._slice_rows(advantages)
        warming_up = self._critic_warming_up(step)
        if self.critic is not None:
            extra["critic/warmup"] = float(warming_up)
        if not warming_up:
            extra.update(self._train_actor(step, local, num_tokens, num_seqs))
            self.scheduler.step(increment=1)
        self.step = step

        metrics = dict(extra)
        metrics.update(self._batch_metrics(batch, advantages))
        metrics["actor/sft"] = float(step <= sft_steps)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        metrics["time/train_step"] = float(elapsed)
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / float(elapsed)
        return metrics

    def _train_actor(
        self, step: int, local: dict[str, Tensor], num_tokens: float, num_seqs: float
    ) -> dict[str, float]:
        """Update the actor on this rank's rows; its metrics (equal on every rank)."""
        settings = self._loss_settings(step, num_tokens, num_seqs)
        micro_batches = self._micro_batches(local)
        sft_lr = self.config.trainer.sft_lr
        if sft_lr is not None and step <= self.config.trainer.sft_warmup_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = sft_lr * group.get("lr_mult", 1.0)
        lr = float(self.optimizer.param_groups[0]["lr"])
        summed, grad_norm = run_update(
            self.model,
            self.optimizer,
            partial(self._forward_step, settings, len(micro_batches)),
            micro_batches,
            grad_clip=self.config.trainer.optim.grad_clip,
            before_update=self._async_saves.wait_for_snapshots,
            what=f"step {step}",
        )
        metrics = step_metrics(summed, num_tokens)
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/lr"] = lr
        return metrics

    def _start_critic_from_actor(self) -> None:
        """At the first RL step after SFT steps, a critic without its own `model_path` takes
        the actor's backbone as it is then (verl's critic starts from the RL actor)."""
        assert self.critic is not None
        if self.config.critic.model_path is None:
            self.critic.start_from(self._gpt)

    def _critic_warming_up(self, step: int) -> bool:
        """Whether step `step` trains only the critic: the first `critic.warmup_steps` steps
        after the SFT steps."""
        if self.critic is None:
            return False
        sft_steps = self.config.trainer.sft_warmup_steps
        return sft_steps < step <= sft_steps + self.config.critic.warmup_steps

    def _critic_step(
        self,
        batch: dict[str, Tensor],
        local: dict[str, Tensor],
        rewards: Tensor,
        num_tokens: float,
        num_seqs: float,
    ) -> tuple[Tensor, dict[str, float]]:
        """GAE advantages [B, L] from the critic's values, then one critic update on the
        returns; the critic's metrics."""
        assert self.critic is not None
        if batch.get("advantages") is not None:
            raise BatchError(
                "'advantages': the rows carry advantages, but algorithm 'ppo' estimates them "
                "with its critic (GAE); write the rows without advantages"
            )
        algo, mask = self.config.algorithm, batch["response_mask"]
        values = self._gather_rows(self.critic.values(local))
        token_rewards = rewards if rewards.dim() == 2 else token_level_rewards(rewards, mask)
        advantages, returns = gae_advantages_and_returns(
            token_rewards, values, mask, gamma=algo.gamma, lam=algo.lam
        )
        metrics = self.critic.train(
            {**local, "values": self._slice_rows(values), "returns": self._slice_rows(returns)},
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            before_update=self._async_saves.wait_for_snapshots,
        )
        kept_values, kept_returns = values.double()[mask], returns.double()[mask]
        for name, kept in (("values", kept_values), ("returns", kept_returns)):
            metrics[f"critic/{name}/mean"] = float(kept.mean())
            metrics[f"critic/{name}/max"] = float(kept.max())
            metrics[f"critic/{name}/min"] = float(kept.min())
        metrics["critic/vf_explained_var"] = explained_variance(returns, values, mask)
        return advantages, metrics

    def _forward_step(
        self, settings: LossSettings, num_microbatches: int, data_iterator, model
    ) -> tuple[Tensor, Any]:
        micro_batch = next(data_iterator)
        packing = self._packing(micro_batch)
        logits = self._logits(self._gpt, micro_batch, packing)
        # The schedule divides by the number of micro-batches and DDP averages over DP ranks;
        # each piece's loss already is its exact share of the batch loss, so undo both.
        scale = num_microbatches * self.parallel.dp_size

        def loss_func(output: Tensor) -> tuple[Tensor, Tensor]:
            logprobs, entropy = self._per_token(
                output, micro_batch, packing, entropy_grad=settings.entropy_coef > 0
            )
            loss, figures = micro_batch_loss(logprobs, entropy, micro_batch, settings)
            return loss * scale, figures

        return logits, loss_func

    def _packing(self, micro_batch: dict[str, Tensor]) -> Packing | None:
        """How the micro-batch's rows are packed, or None when padded rows are trained."""
        if not self.config.trainer.sequence_packing:
            return None
        return Packing.of(micro_batch["attention_mask"])

    @staticmethod
    def _logits(model: GPTModel, micro_batch: dict[str, Tensor], packing: Packing | None) -> Tensor:
        """This rank's logits shard: [b, T, V] padded, or [1, S, V] packed."""
        if packing is None:
            return local_logits(model, micro_batch["tokens"], micro_batch["attention_mask"])
        return packed_local_logits(model, packing.pack(micro_batch["tokens"]), packing)

    def _per_token(
        self,
        logits: Tensor,
        micro_batch: dict[str, Tensor],
        packing: Packing | None,
        *,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        """(log-probs [b, T], entropy [b, T]) of the micro-batch's tokens from `_logits`."""
        tokens = micro_batch["tokens"]
        logprobs, entropy = token_logprobs_and_entropy(
            logits,
            tokens if packing is None else packing.pack(tokens),
            temperature=self.config.explorer.temperature,
            entropy_grad=entropy_grad,
        )
        if packing is None:
            return logprobs, entropy
        return packing.unpack(logprobs), packing.unpack(entropy)

    def _local_slice(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return {
            key: self._slice_rows(batch[key])
            for key in MICRO_BATCH_KEYS
            if batch.get(key) is not None
        }

    def _slice_rows(self, tensor: Tensor) -> Tensor:
        rows = tensor.shape[0] // self.parallel.dp_size
        start = self.parallel.dp_rank * rows
        return tensor[start : start + rows]

    def _micro_batches(self, local: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        return split_micro_batches(local, self.config.trainer.micro_batch_size)

    @torch.no_grad()
    def _logprobs(self, model: GPTModel, local: dict[str, Tensor]) -> Tensor:
        """Log-probs [b, L] of the local rows' tokens under `model`, zero-padded to L."""
        out = torch.zeros(local["tokens"].shape, dtype=torch.float32, device=self.parallel.device)
        was_training = model.training
        model.eval()
        for start, piece in zip(
            range(0, out.shape[0], self.config.trainer.micro_batch_size),
            self._micro_batches(local),
            strict=True,
        ):
            packing = self._packing(piece)
            logits = self._logits(model, piece, packing)
            logprobs, _ = self._per_token(logits, piece, packing, entropy_grad=False)
            rows, length = logprobs.shape
            out[start : start + rows, :length] = logprobs.float()
        model.train(was_training)
        return out

    def _advantages(
        self,
        step: int,
        batch: dict[str, Tensor],
        local: dict[str, Tensor],
        num_tokens: float,
        num_seqs: float,
    ) -> tuple[Tensor, dict[str, float]]:
        """Advantages [B, L] of the whole batch, and the metrics of what made them: a KL
        penalty, and the critic's update under PPO."""
        if self.critic is None and batch.get("advantages") is not None:
            return batch["advantages"].float(), {}
        if self.critic is not None and step <= self.config.trainer.sft_warmup_steps:
            return torch.zeros_like(batch["old_logprobs"]), {}  # demonstrations: no critic
        rewards, extra = self._rewards(batch, local)
        if self.critic is None:
            advantages = advantages_from_config(
                self.config.algorithm, rewards, batch["group_index"], batch["response_mask"]
            )
            return advantages.float(), extra
        advantages, critic_metrics = self._critic_step(batch, local, rewards, num_tokens, num_seqs)
        return advantages, {**extra, **critic_metrics}

    def _rewards(
        self, batch: dict[str, Tensor], local: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, float]]:
        """The whole batch's rewards ([B], or token-level [B, L] after a KL penalty) and the
        penalty's metrics if one is applied."""
        algo = self.config.algorithm
        rewards: Tensor = batch["rewards"].float()
        extra: dict[str, float] = {}
        if algo.kl_penalty_fn != "none" and algo.kl_penalty_coef > 0:
            local_rewards, kl_metrics = apply_kl_penalty(
                self._slice_rows(rewards),
                local["old_logprobs"],
                local["ref_logprobs"],
                local["response_mask"],
                algo.kl_penalty_fn,
                algo.kl_penalty_coef,
            )
            rewards = self._gather_rows(local_rewards)
            mean_kl = kl_metrics["kl"].reshape(1).double()
            dist.all_reduce(mean_kl, group=parallel_state.get_data_parallel_group())
            extra = {
                "critic/kl": float(mean_kl) / self.parallel.dp_size,
                "critic/kl_coef": algo.kl_penalty_coef,
            }
        return rewards, extra

    def _gather_rows(self, local: Tensor) -> Tensor:
        """The whole batch's rows, gathered in rank order from every data-parallel rank."""
        if self.parallel.dp_size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.parallel.dp_size)]
        dist.all_gather(pieces, local.contiguous(), group=parallel_state.get_data_parallel_group())
        return torch.cat(pieces)

    def _loss_settings(self, step: int, num_tokens: float, num_seqs: float) -> LossSettings:
        algo = self.config.algorithm
        sft = step <= self.config.trainer.sft_warmup_steps
        return LossSettings(
            policy_loss_fn="sft" if sft else algo.policy_loss_fn,
            clip_range_low=algo.clip_range_low,
            clip_range_high=algo.clip_range_high,
            dual_clip=algo.dual_clip,
            loss_agg_mode=algo.loss_agg_mode,
            kl_loss_fn=algo.kl_loss_fn,
            kl_loss_coef=algo.kl_loss_coef,
            entropy_coef=algo.entropy_coef,
            temperature=self.config.explorer.temperature,
            max_response_len=self.config.model.max_response_tokens,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
        )

    @staticmethod
    def _batch_metrics(batch: dict[str, Tensor], advantages: Tensor) -> dict[str, float]:
        rewards = batch["rewards"].double()
        mask = batch["response_mask"]
        return {
            "critic/rewards/mean": float(rewards.mean()),
            "critic/rewards/max": float(rewards.max()),
            "critic/rewards/min": float(rewards.min()),
            "critic/advantages/mean": float(advantages.double()[mask].mean()),
            "response_length/mean": float(mask.sum(dim=1).double().mean()),
            "perf/total_num_tokens": float(batch["attention_mask"].sum()),
        }

    # -- state ----------------------------------------------------------------------------

    def _layout(self) -> Layout:
        return Layout(
            world_size=self.parallel.world_size,
            tensor_model_parallel_size=self.parallel.tp_size,
            pipeline_model_parallel_size=self.parallel.pp_size,
            data_parallel_size=self.parallel.dp_size,
        )

    def _sharded_state_dict(self, *, loading_from: Path | None = None) -> dict[str, Any]:
        """What a state directory holds: to save now, or to load from `loading_from`.

        An optimizer that has not stepped yet holds nothing and is not saved (the actor
        during the critic's warm-up, the critic during SFT steps); a load restores an
        optimizer only if the directory has it.
        """
        is_loading = loading_from is not None
        saved = (
            dist_checkpointing.load_common_state_dict(str(loading_from / DIST_DIR))
            if loading_from is not None
            else None
        )
        model_sd = self._gpt.sharded_state_dict()
        state: dict[str, Any] = {
            "model": model_sd,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }
        if _with_optimizer(self.optimizer, saved):
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        if self.critic is not None:
            if saved is not None and CRITIC_STATE_KEY not in saved:
                raise EngineStateError(
                    f"{loading_from} holds no critic: it was saved by a run without one, and "
                    "this engine trains PPO's critic"
                )
            state[CRITIC_STATE_KEY] = self.critic.sharded_state_dict(
                is_loading=is_loading,
                with_optimizer=_with_optimizer(
                    self.critic.optimizer, None if saved is None else saved[CRITIC_STATE_KEY]
                ),
            )
        return state

    def save_state(self, ckpt_dir: Path, *, background: bool = False) -> EngineStateSave:
        """Save weights, optimizer, LR scheduler, RNG states and step to `ckpt_dir`; under PPO
        the critic's weights, optimizer and scheduler too.

        With `background`, tensors are written in the background and training may go on;
        the returned handle's `done()`/`wait()` are collective (call them on every rank).
        The model's HF config and tokenizer go to `model/` (the critic's config to
        `critic_model/`), so the state converts on its own.
        """
        if self.parallel.is_rank0:
            copy_model_description(self.hf_dir, Path(ckpt_dir) / MODEL_DESCRIPTION_DIR)
            if self.critic is not None:
                critic_dir = Path(ckpt_dir) / CRITIC_DESCRIPTION_DIR
                critic_dir.mkdir(parents=True, exist_ok=True)
                write_text_atomic(
                    critic_dir / "config.json", json.dumps(self.critic.description(), indent=2)
                )
        return save_engine_state(
            Path(ckpt_dir),
            self._sharded_state_dict(),
            step=self.step,
            layout=self._layout(),
            queue=self._async_saves if background else None,
        )

    def load_state(self, ckpt_dir: Path) -> None:
        """Restore the exact state saved in `ckpt_dir`: weights, optimizer, scheduler, RNG."""
        self._async_saves.finalize(blocking=True)
        read_engine_state(Path(ckpt_dir))  # a complete state, or a clear error
        loaded, meta = load_engine_state(
            Path(ckpt_dir), self._sharded_state_dict(loading_from=Path(ckpt_dir)), self._layout()
        )
        self._gpt.load_state_dict(loaded["model"])
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            self.optimizer.reload_model_params()
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(loaded["scheduler"])
        if self.critic is not None:
            self.critic.load_state(loaded[CRITIC_STATE_KEY])
        self.step = int(meta["step"])

    def load_weights(self, ckpt_dir: Path) -> None:
        """Restore only the weights of a saved state, the critic's too when this engine has
        one (no optimizer, scheduler or RNG).

        For exporting a checkpoint whatever the run's optimizer or schedule settings were.
        """
        meta = read_engine_state(Path(ckpt_dir))
        self._async_saves.wait_for_snapshots()
        wanted: dict[str, Any] = {"model": self._gpt.sharded_state_dict()}
        if self.critic is not None:
            wanted[CRITIC_STATE_KEY] = self.critic.sharded_state_dict(
                is_loading=True, with_optimizer=False
            )["model"]
        loaded = dist_checkpointing.load(wanted, str(Path(ckpt_dir) / DIST_DIR))
        self._gpt.load_state_dict(loaded["model"], strict=False)
        if self.critic is not None:
            self.critic.load_weights(loaded[CRITIC_STATE_KEY])
        self.step = int(meta["step"])

    # -- weights out ----------------------------------------------------------------------

    def export_hf(self, out_dir: Path) -> None:
        """Write the current weights as a Hugging Face directory (collective)."""
        hf_weights.export_model_to_hf(self._gpt, self.hf_config, Path(out_dir), self.hf_dir)

    def export_critic_hf(self, out_dir: Path) -> None:
        """Write the critic as an HF token-classification directory (collective)."""
        if self.critic is None:
            raise ValueError("this engine has no critic: the algorithm is not 'ppo'")
        self.critic.export_hf(Path(out_dir), self.hf_dir)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The current weights under HF names, full tensors on global rank 0 (collective).

        Every other rank gets an empty dict.
        """
        return hf_weights.hf_state_dict_from_model(self._gpt, self.hf_config)

    def close(self) -> None:
        """Finish pending background saves and tear down the process groups."""
        self._async_saves.close()
        destroy_distributed()


def _with_optimizer(optimizer: Any, saved: dict[str, Any] | None) -> bool:
    """Whether a state holds `optimizer`: it has stepped (saving), or the `saved` common
    state of its model has an "optimizer" entry (loading)."""
    return has_stepped(optimizer) if saved is None else "optimizer" in saved


__all__ = ["BatchError", "StepOrderError", "TrainEngine"]
