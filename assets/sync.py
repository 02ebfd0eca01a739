"""`synced_weights`: weights of a step published to explorers, on a user's request.

The trainer loop publishes weights as its sync rules say and logs `synced_weights[N]` itself
(`assets.train_loop`). Materialising `synced_weights[N]` from the UI is "sync now": during
training the running loop publishes the current step's weights at its next step boundary
(or at once while it waits for data) and this run records them; weights already published
are recorded at once. With no trainer loop alive the run publishes through the engine
itself. It takes no `engine` pool slot, so it never waits for the end of training.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from assets.control import ask_trainer, request_id
from assets.partitions import step_partitions
from assets.step_runs import run_steps, step_materialization
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.publish import published_info
from trinity_dagster.graph_names import SYNCED, TRAIN
from trinity_dagster.handoff import control


def sync_metadata(info: dict[str, Any]) -> dict[str, Any]:
    """Version, size and where published weights are: their path, or for weights held for
    collective transfers (sync_method `nccl`) the address explorers receive them from."""
    where: dict[str, Any] = (
        {"path": dg.MetadataValue.path(info["path"])}
        if "path" in info
        else {"sent_from": f"{info['backend']} group at {info['address']}:{info['port']}"}
    )
    return {"version": info["version"], **where, "size_bytes": info["size_bytes"]}


@dg.multi_asset(
    name="publish",
    specs=[
        dg.AssetSpec(
            SYNCED,
            deps=[TRAIN],
            skippable=True,
            partitions_def=step_partitions,
            group_name="checkpoints",
            kinds={"safetensors"},
            description="Weights of step N published to explorers (HF format, by version).",
        )
    ],
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def publish(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, engine: EngineResource
) -> Iterator[dg.AssetMaterialization]:
    """Publish (or record) weights version N for each of the run's steps."""
    paths = run_config.paths
    for step in run_steps(context):
        info = published_info(paths, step)
        if info is None:
            info = ask_trainer(context, run_config, "sync", step=step)
            control.forget(paths, request_id(context, "sync", step))
        if info is None:
            info = engine.wrapper().publish(step)
        yield step_materialization(SYNCED, step, sync_metadata(info))
