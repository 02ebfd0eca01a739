"""Progress beats of a train step: hooks that report each layer's forward, each layer's
gradient and the optimizer step, so that a hung step is told from a long one.

The engine service's `status` says how long ago the last beat was (`since_progress_s`); the
engine wrapper kills a service whose train step makes no progress for too long. The hooks
return nothing, so they change no tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from trinity_dagster.engine.engine import TrainEngine

Beat = Callable[[str], None]


def install_progress_hooks(engine: TrainEngine, beat: Beat) -> None:
    """Call `beat(window)` at every transformer layer's forward (`train_forward`) and
    gradient (`train_backward`), and before each optimizer step (`optimizer_step`)."""
    for module in engine.model.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_pre_hook(lambda *_: beat("train_forward"))
            first = next((p for p in module.parameters() if p.requires_grad), None)
            if first is not None:
                first.register_hook(lambda _grad: beat("train_backward"))
    for optimizer in torch_optimizers(engine.optimizer):
        optimizer.register_step_pre_hook(lambda *_: beat("optimizer_step"))


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for part in chained for inner in torch_optimizers(part)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []
