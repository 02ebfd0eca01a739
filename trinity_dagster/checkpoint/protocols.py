"""What the checkpoint manager needs from a training engine (the Megatron `TrainEngine` has it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor


@runtime_checkable
class SaveHandle(Protocol):
    """A save in progress. `done()` is True once it finished, well or not; `wait()` blocks until
    then and raises the save's error, if any."""

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        ...

    def wait(self) -> None:
        """Block until the save has finished; raise its error if it failed."""
        ...


@runtime_checkable
class StateProvider(Protocol):
    """A trainer whose full state (model, optimizer, scheduler, RNG, step) can be saved/loaded."""

    @property
    def step(self) -> int:
        """The last completed train step (0 before training)."""
        ...

    def save_state(self, ckpt_dir: Path, *, background: bool = False) -> SaveHandle:
        """Write the full state into the existing, empty `ckpt_dir`."""
        ...

    def load_state(self, ckpt_dir: Path) -> None:
        """Restore the full state from `ckpt_dir`."""
        ...

    def export_hf(self, out_dir: Path) -> None:
        """Write the current weights as a Hugging Face directory into `out_dir`."""
        ...

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The current weights as full tensors with Hugging Face names."""
        ...
