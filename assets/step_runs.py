"""Step-partitioned runs: the steps a run covers, and one materialisation per step.

A `MaterializeResult` in a ranged (single-run backfill) run gives every partition of the
range the same metadata, and one that is yielded before the work is done would mark steps
that later fail. So the step-partitioned assets are declared skippable and log one
`AssetMaterialization` per step, with that step's own metadata, as soon as the step is
done: a run over steps a..b shows each step's metrics in the UI's plots, and a failure at
step k leaves a..k-1 recorded and k..b not.

A run tagged `trinity/until_data_ends` (the sensor's runs when `trainer.total_steps` is
unset) starts at its first step and goes on until the data ends; it adds each later step's
partition as it records the step, so the partitions are exactly the steps done.
"""

from typing import Any

import dagster as dg

from assets.partitions import STEP_PARTITIONS, step_key, step_of
from trinity_dagster.graph_names import UNTIL_DATA_ENDS_TAG


def run_steps(context: dg.AssetExecutionContext) -> list[int]:
    """The training steps of this run's partitions, in ascending order."""
    return sorted(step_of(key) for key in context.partition_keys)


def run_last_step(context: dg.AssetExecutionContext) -> int | None:
    """The last step this run covers; None for a run that goes on until the data ends."""
    if context.run.tags.get(UNTIL_DATA_ENDS_TAG) == "true":
        return None
    return run_steps(context)[-1]


class StepPartitions:
    """Adds the step partitions a run records beyond the ones that exist (an open-ended run)."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self.known = set(instance.get_dynamic_partitions(STEP_PARTITIONS))

    def ensure(self, step: int) -> None:
        """Make sure step N's partition exists."""
        key = step_key(step)
        if key not in self.known:
            self.instance.add_dynamic_partitions(STEP_PARTITIONS, [key])
            self.known.add(key)


def step_materialization(
    asset: str, step: int, metadata: dict[str, Any], tags: dict[str, str] | None = None
) -> dg.AssetMaterialization:
    """The materialisation of one step partition of `asset` (with Dagster's event `tags`, such
    as its data version)."""
    return dg.AssetMaterialization(
        asset_key=asset, partition=step_key(step), metadata=metadata, tags=tags
    )


def numeric_metadata(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of `values` as floats (the UI plots these per partition)."""
    return {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
