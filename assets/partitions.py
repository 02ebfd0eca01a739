"""Partitioning: one partition per training step, keyed by the zero-padded step."""

import dagster as dg

STEP_KEY_WIDTH = 6

step_partitions = dg.DynamicPartitionsDefinition(name="step")


def step_key(step: int) -> str:
    """The partition key of a training step (`42` -> `"000042"`)."""
    if step < 0:
        raise ValueError(f"a training step is >= 0, got {step}")
    return f"{step:0{STEP_KEY_WIDTH}d}"


def step_of(key: str) -> int:
    """The training step of a partition key (`"000042"` -> `42`)."""
    if not key.isdigit():
        raise ValueError(f"not a step partition key: {key!r}")
    return int(key)
