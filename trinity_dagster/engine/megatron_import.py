"""Importing megatron-core without its just-in-time fuser, for processes that only train.

As its modules are imported, megatron-core 0.16 decorates 41 functions (GELU variants,
bias-activation and bias-dropout fusions, MoE routing helpers) with `megatron.core.jit.jit_fuser`,
which is `torch.compile` on torch >= 2.2. Each `torch.compile` call imports torch's compiler
stack (dynamo, inductor, their code generators, networkx): measured here, 2 s of an engine
rank's import and 68 MB of its memory. The engine's models call none of those functions
(`engine.model` turns every fusion off), so a rank imports megatron-core with the fuser as
megatron's own no-op decorator, the one `megatron.core.jit.disable_jit_fuser` installs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def _uncompiled(model: Callable[..., Any] | None = None, **_options: Any) -> Any:
    """`torch.compile`'s calling forms, returning the function itself."""
    if model is None:
        return lambda function: function
    return model


def import_megatron_core_without_jit_fuser() -> bool:
    """Import megatron-core with `jit_fuser` a no-op; False if it was imported before (then
    its decorated functions are compiled ones and this changes nothing)."""
    if "megatron.core" in sys.modules:
        return False
    compile_ = torch.compile
    torch.compile = _uncompiled
    try:
        import megatron.core  # noqa: F401  (the import is the point)
        from megatron.core.jit import disable_jit_fuser

        disable_jit_fuser()  # for megatron modules imported later
    finally:
        torch.compile = compile_
    return True
