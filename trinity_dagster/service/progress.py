"""Progress beats of a train step: hooks that report each layer's forward, each layer's
gradient and the optimizer step, so that a hung step is told from a long one.

The engine service's `status` says how long ago the last beat was (`since_progress_s`); the
engine wrapper kills a service whose train step makes no progress for too long. The hooks
return nothing, so they change no tensor.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.core.transformer.transformer_layer import TransformerLayer

from trinity_dagster.engine.engine import TrainEngine
from trinity_dagster.engine.optim import torch_optimizers

Beat = Callable[[str], None]


def install_progress_hooks(engine: TrainEngine, beat: Beat) -> None:
    """Call `beat(window)` at every transformer layer's forward (`train_forward`) and
    gradient (`train_backward`), and before each optimizer step (`optimizer_step`), of the
    actor and, under PPO, of the critic."""
    models, optimizers = [engine.model], [engine.optimizer]
    if engine.critic is not None:
        models.append(engine.critic.model)
        optimizers.append(engine.critic.optimizer)
    for model in models:
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                module.register_forward_pre_hook(lambda *_: beat("train_forward"))
                first = next((p for p in module.parameters() if p.requires_grad), None)
                if first is not None:
                    first.register_hook(lambda _grad: beat("train_backward"))
    for optimizer in optimizers:
        for inner in torch_optimizers(optimizer):
            inner.register_step_pre_hook(lambda *_: beat("optimizer_step"))
