"""`Critic`: PPO's value model on the engine, with its own optimizer and learning-rate schedule.

It lives beside the actor in `TrainEngine` on every rank, in the same tensor/data-parallel
layout: it estimates per-token values for GAE and trains on the returns with the clipped
value loss. It is saved in the engine's state and never published to explorers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from trinity_dagster.algorithms.value import value_loss
from trinity_dagster.config import TrinityConfig
from trinity_dagster.engine import hf_weights
from trinity_dagster.engine.optim import prepare_training, run_update
from trinity_dagster.engine.packing import Packing, split_micro_batches
from trinity_dagster.engine.parallel import ParallelInfo
from trinity_dagster.engine.value_model import (
    build_value_model,
    token_classification_config,
    token_values,
)

# The critic's keys in the engine's sharded state (its tensors' keys start with this too).
STATE_KEY = "critic"
# Order of the summed per-micro-batch figures of a critic update.
_SUM_KEYS = ("vf_loss", "vf_clipfrac", "vpred_sum")


class CriticSourceError(ValueError):
    """The critic's starting model does not fit the actor; the message names the file."""


class Critic:
    """The value model of this rank: build it after the actor (distributed state is set)."""

    def __init__(
        self,
        config: TrinityConfig,
        parallel: ParallelInfo,
        source_dir: Path,
        *,
        vocab_size: int,
        load_weights: bool = True,
    ) -> None:
        """Build the value model from the HF directory `source_dir` (weights too unless
        `load_weights` is False), its DDP wrapper, optimizer and schedule."""
        self.config = config
        self.parallel = parallel
        config_file = Path(source_dir) / "config.json"
        self.hf_config: dict[str, Any] = json.loads(config_file.read_text())
        if self.hf_config.get("vocab_size") != vocab_size:
            raise CriticSourceError(
                f"{config_file}: vocab_size {self.hf_config.get('vocab_size')} differs from the "
                f"actor's {vocab_size}; the critic reads the actor's tokens"
            )
        self.gpt: GPTModel = build_value_model(
            self.hf_config,
            config.megatron,
            params_dtype=config.megatron.params_dtype,
            head_seed=config.trainer.seed,
        )
        if load_weights:
            hf_weights.load_hf_into_model(self.gpt, source_dir)
        self.model, self.optimizer, self.scheduler = prepare_training(
            self.gpt, config.critic.optim, config.megatron, config.trainer.total_steps
        )

    @torch.no_grad()
    def start_from(self, actor: GPTModel) -> None:
        """Copy the actor's current weights into the critic's backbone (the head stays).

        The actor must have the critic's architecture and parallel layout: the critic was
        built from the actor's starting model."""
        source = dict(actor.named_parameters())
        for name, param in self.gpt.named_parameters():
            if not name.startswith("output_layer."):
                param.copy_(source[name])
        self.optimizer.reload_model_params()  # fp32 main copies under bf16

    def _packing(self, micro_batch: dict[str, Tensor]) -> Packing | None:
        if not self.config.trainer.sequence_packing:
            return None
        return Packing.of(micro_batch["attention_mask"])

    def _micro_batches(self, local: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        return split_micro_batches(local, self.config.trainer.micro_batch_size)

    @torch.no_grad()
    def values(self, local: dict[str, Tensor]) -> Tensor:
        """Values [b, L] of this rank's rows (zero-padded to L), without gradient."""
        out = torch.zeros(local["tokens"].shape, dtype=torch.float32, device=self.parallel.device)
        self.gpt.eval()
        size = self.config.trainer.micro_batch_size
        for start, piece in zip(
            range(0, out.shape[0], size), self._micro_batches(local), strict=True
        ):
            values = token_values(self.gpt, piece, self._packing(piece))
            rows, length = values.shape
            out[start : start + rows, :length] = values
        self.gpt.train()
        return out

    def train(
        self,
        local: dict[str, Tensor],
        *,
        num_tokens: float,
        num_seqs: float,
        before_update: Callable[[], None],
    ) -> dict[str, float]:
        """One update on this rank's rows (`values` before the update and `returns` among
        them); the critic's metrics, equal on every rank. `before_update` runs just before the
        weights change (the engine waits there for background-save snapshots)."""
        keys = ("tokens", "attention_mask", "response_mask", "values", "returns")
        micro_batches = self._micro_batches({key: local[key] for key in keys})
        lr = float(self.optimizer.param_groups[0]["lr"])
        summed, grad_norm = run_update(
            self.model,
            self.optimizer,
            partial(self._forward_step, len(micro_batches), num_tokens, num_seqs),
            micro_batches,
            grad_clip=self.config.critic.optim.grad_clip,
            before_update=before_update,
            what="the critic's update",
        )
        self.scheduler.step(increment=1)
        figures = dict(zip(_SUM_KEYS, summed.tolist(), strict=True))
        return {
            "critic/vf_loss": figures["vf_loss"],
            "critic/vf_clipfrac": figures["vf_clipfrac"],
            "critic/vpred_mean": figures["vpred_sum"] / num_tokens,
            "critic/grad_norm": grad_norm,
            "critic/lr": lr,
        }

    def _forward_step(
        self, num_microbatches: int, num_tokens: float, num_seqs: float, data_iterator, model
    ) -> tuple[Tensor, Any]:
        micro_batch = next(data_iterator)
        vpreds = token_values(self.gpt, micro_batch, self._packing(micro_batch))
        # As the actor's: each piece's loss is its exact share of the batch's, so undo the
        # schedule's division by the micro-batches and DDP's average over data-parallel ranks.
        scale = num_microbatches * self.parallel.dp_size

        def loss_func(output: Tensor) -> tuple[Tensor, Tensor]:
            loss, metrics = value_loss(
                output,
                micro_batch["returns"],
                micro_batch["values"],
                micro_batch["response_mask"],
                cliprange_value=self.config.critic.cliprange_value,
                loss_agg_mode=self.config.critic.loss_agg_mode,
                global_num_tokens=num_tokens,
                global_num_seqs=num_seqs,
                max_response_len=self.config.model.max_response_tokens,
            )
            pieces = (loss.detach(), metrics["vf_clipfrac"], metrics["vpred_sum"])
            return loss * scale, torch.stack([p.to(torch.float64) for p in pieces])

        return vpreds, loss_func

    # -- state ----------------------------------------------------------------------------

    def sharded_state_dict(self, *, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
        """Weights, schedule and (`with_optimizer`) optimizer for the engine's
        dist-checkpoint."""
        model_sd = self.gpt.sharded_state_dict(prefix=f"{STATE_KEY}.")
        state = {"model": model_sd, "scheduler": self.scheduler.state_dict()}
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        return state

    def load_state(self, loaded: dict[str, Any]) -> None:
        """Restore what `sharded_state_dict` saved (after dist_checkpointing loaded it)."""
        self.gpt.load_state_dict(_unprefixed(loaded["model"]))
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            self.optimizer.reload_model_params()
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(loaded["scheduler"])

    def load_weights(self, loaded_model: dict[str, Any]) -> None:
        """Restore only the weights from a loaded `sharded_state_dict()["model"]`."""
        self.gpt.load_state_dict(_unprefixed(loaded_model), strict=False)

    def description(self) -> dict[str, Any]:
        """The HF config of the critic as a token-classification model (for its export)."""
        return token_classification_config(self.hf_config)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The critic's weights under HF token-classification names on global rank 0."""
        return hf_weights.hf_state_dict_from_model(self.gpt, self.hf_config)

    def export_hf(self, out_dir: Path, tokenizer_src: Path) -> None:
        """Write the critic as an HF token-classification directory (collective)."""
        hf_weights.export_model_to_hf(self.gpt, self.description(), out_dir, tokenizer_src)


def _unprefixed(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with the critic's key prefix taken off (a module's own state-dict names)."""
    prefix = f"{STATE_KEY}."
    return {key.removeprefix(prefix): value for key, value in state.items()}
