"""Partitioning: one partition per training step, keyed by the zero-padded step (`step_key`),
and one per evaluated weights version (same keys: version N is step N's weights, and version 0
the initial model, which no step trained)."""

import dagster as dg

from trinity_dagster.steps import step_key, step_of

__all__ = ["step_key", "step_of", "step_partitions", "weights_partitions"]

step_partitions = dg.DynamicPartitionsDefinition(name="step")
weights_partitions = dg.DynamicPartitionsDefinition(name="weights_version")
