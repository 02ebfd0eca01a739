"""Step-partitioned runs: the steps a run covers, and one materialisation per step.

A `MaterializeResult` in a ranged (single-run backfill) run gives every partition of the
range the same metadata, and one that is yielded before the work is done would mark steps
that later fail. So the step-partitioned assets are declared skippable and log one
`AssetMaterialization` per step, with that step's own metadata, as soon as the step is
done: a run over steps a..b shows each step's metrics in the UI's plots, and a failure at
step k leaves a..k-1 recorded and k..b not.
"""

from typing import Any

import dagster as dg

from assets.partitions import step_key, step_of


def run_steps(context: dg.AssetExecutionContext) -> list[int]:
    """The training steps of this run's partitions, in ascending order."""
    return sorted(step_of(key) for key in context.partition_keys)


def step_materialization(
    asset: str, step: int, metadata: dict[str, Any]
) -> dg.AssetMaterialization:
    """The materialisation of one step partition of `asset`."""
    return dg.AssetMaterialization(asset_key=asset, partition=step_key(step), metadata=metadata)


def numeric_metadata(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of `values` as floats (the UI plots these per partition)."""
    return {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
