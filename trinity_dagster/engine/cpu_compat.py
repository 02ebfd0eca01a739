"""The CPU layer: lets Megatron-core 0.16 run on CPU (gloo) when no CUDA device is present.

Megatron-core assumes CUDA in a few places: `torch.cuda.current_device()` for buffers,
tensors created with `device="cuda"`, the CUDA RNG state tracker, `torch.cuda.synchronize`
and a `grad.type() == "torch.cuda.FloatTensor"` assertion in gradient clipping. On a machine
without CUDA, `enable_cpu_compat()` installs, once per process:

- a `TorchFunctionMode` that rewrites CUDA devices (``"cuda"``, ``"cuda:N"``, device
  indices, ``torch.device("cuda")``) to the CPU in every torch call, makes `Tensor.cuda()`
  a no-op and reports CPU float tensors' `type()` under their CUDA name;
- `torch.cuda.current_device` returning 0 and `torch.cuda.synchronize` doing nothing;
- an RNG state tracker that keeps Megatron's named RNG streams as CPU generator states.

With CUDA present it does nothing. The default causal mask of Megatron's local attention is
not fixed here: callers pass an explicit attention mask (see `engine.model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_active = False


def cpu_compat_needed(cuda_available: bool | None = None) -> bool:
    """Whether the CPU layer is needed: True when CUDA is unavailable.

    `cuda_available` defaults to `torch.cuda.is_available()`.
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return not cuda_available


def cpu_compat_active() -> bool:
    """Whether `enable_cpu_compat()` has activated the CPU layer in this process."""
    return _active


def enable_cpu_compat() -> bool:
    """Activate the CPU layer if CUDA is unavailable; idempotent. Returns whether it is active."""
    global _active
    if _active:
        return True
    if not cpu_compat_needed():
        return False
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    _install_cpu_rng_tracker()
    _CudaToCpuMode().__enter__()
    _active = True
    return True


def _current_device() -> int:
    return 0


def _synchronize(device: Any = None) -> None:
    return None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


_CPU = torch.device("cpu")


class _CudaToCpuMode(TorchFunctionMode):
    """Runs every torch call with CUDA devices replaced by the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs on every torch call of the process: the common case (no CUDA device) copies
        # nothing.
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name.removeprefix("torch.")
            return name
        if not kwargs:
            kwargs = {}
        elif "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class _CpuRNGStatesTracker:
    """Megatron's named RNG streams, kept as CPU generator states (mixin for the tracker)."""

    states_: dict[str, torch.Tensor]
    seeds_: set[int]
    _current_state_name: str

    def add(self, name: str, seed: int) -> None:
        """Track a new CPU RNG stream `name` seeded with `seed`."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block with the CPU RNG set to stream `name`, then restore the previous state."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    tracker_cls = type(
        "CpuRNGStatesTracker", (_CpuRNGStatesTracker, mp_random.CudaRNGStatesTracker), {}
    )

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mp_random.CudaRNGStatesTracker = tracker_cls
    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = get_state
    torch.cuda.set_rng_state = set_state
    mp_random.initialize_rng_tracker(force_reset=True)
