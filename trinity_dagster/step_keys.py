"""A training step written in names: Dagster partition keys and per-step record files.

Zero-padded to `STEP_KEY_WIDTH` digits, so that names sort in step order (`42` -> `"000042"`).
"""

STEP_KEY_WIDTH = 6


def step_key(step: int) -> str:
    """The name of a training step (`42` -> `"000042"`)."""
    if step < 0:
        raise ValueError(f"a training step is >= 0, got {step}")
    return f"{step:0{STEP_KEY_WIDTH}d}"


def step_of(key: str) -> int:
    """The training step a name stands for (`"000042"` -> `42`)."""
    if not key.isdigit():
        raise ValueError(f"not a step key: {key!r}")
    return int(key)
