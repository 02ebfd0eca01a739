"""Partitioning: one partition per training step, keyed by the zero-padded step (`step_key`)."""

import dagster as dg

from trinity_dagster.steps import step_key, step_of

__all__ = ["step_key", "step_of", "step_partitions"]

step_partitions = dg.DynamicPartitionsDefinition(name="step")
