"""Partitioning: one partition per training step, keyed by the zero-padded step (`step_key`),
and one per evaluated weights version (same keys: version N is step N's weights, and version 0
the initial model, which no step trained)."""

import dagster as dg

from trinity_dagster.step_keys import step_key, step_of

__all__ = [
    "STEP_PARTITIONS",
    "WEIGHTS_PARTITIONS",
    "step_key",
    "step_of",
    "step_partitions",
    "weights_partitions",
]

STEP_PARTITIONS = "step"
WEIGHTS_PARTITIONS = "weights_version"
step_partitions = dg.DynamicPartitionsDefinition(name=STEP_PARTITIONS)
weights_partitions = dg.DynamicPartitionsDefinition(name=WEIGHTS_PARTITIONS)
