"""`checkpoint`, `hf_model` and `synced_weights`: what training left on disk, per step.

The engine writes checkpoints and publishes weights right after the step that calls for
them (DESIGN §5), so these assets confirm and record what exists: path, size and manifest
checksum, or weights version and path. Asked for a step the engine did not save or sync
yet, the engine does it now if it is still at that step, and refuses otherwise.
"""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg

from assets.partitions import step_partitions
from assets.steps import run_steps, step_materialization
from assets.training import ENGINE_POOL, TRAIN
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.layout import HF_SUBDIR, checkpoint_dir
from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint

CHECKPOINT = "checkpoint"
HF_MODEL = "hf_model"
SYNCED = "synced_weights"


@dg.multi_asset(
    name="save",
    specs=[
        dg.AssetSpec(
            CHECKPOINT,
            deps=[TRAIN],
            skippable=True,
            partitions_def=step_partitions,
            group_name="checkpoints",
            kinds={"pytorch"},
            description="A complete, verified full checkpoint of step N (manifest written last).",
        ),
        dg.AssetSpec(
            HF_MODEL,
            deps=[CHECKPOINT],
            skippable=True,
            partitions_def=step_partitions,
            group_name="checkpoints",
            kinds={"huggingface"},
            description="A Hugging Face directory of step N's weights.",
        ),
    ],
    check_specs=[dg.AssetCheckSpec("checkpoint_complete", asset=CHECKPOINT)],
    can_subset=True,
    backfill_policy=dg.BackfillPolicy.single_run(),
    pool=ENGINE_POOL,
)
def save(
    context: dg.AssetExecutionContext, run_config: RunConfigResource, engine: EngineResource
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckResult]:
    """Record (or write) step N's checkpoint and its Hugging Face export."""
    selected = {key.to_user_string() for key in context.selected_asset_keys}
    problems: list[str] = []
    for step in run_steps(context):
        ckpt = checkpoint_dir(run_config.paths, step)
        if CHECKPOINT in selected:
            info = engine.save_checkpoint(step, hf=HF_MODEL in selected)
            yield step_materialization(
                CHECKPOINT,
                step,
                {
                    "path": dg.MetadataValue.path(info["path"]),
                    "size_bytes": info["size_bytes"],
                    "files": info["files"],
                    "manifest_sha256": info["manifest_sha256"],
                },
            )
            try:
                verify_checkpoint(ckpt)
            except CorruptCheckpointError as err:
                problems.append(f"step {step}: {err}")
        if HF_MODEL in selected:
            hf_dir = ckpt / HF_SUBDIR
            if not (hf_dir / "config.json").is_file():
                convert_checkpoint(ckpt, hf_dir)
            yield step_materialization(
                HF_MODEL,
                step,
                {
                    "path": dg.MetadataValue.path(str(hf_dir)),
                    "size_bytes": sum(p.stat().st_size for p in hf_dir.iterdir() if p.is_file()),
                },
            )
    if CHECKPOINT in selected:
        yield dg.AssetCheckResult(
            asset_key=CHECKPOINT,
            check_name="checkpoint_complete",
            passed=not problems,
            metadata={"problems": "; ".join(problems) or "none"},
        )


def convert_checkpoint(ckpt: Path, out: Path) -> None:
    """Export a full checkpoint to a Hugging Face directory with `trinity-dagster convert`."""
    command = [
        sys.executable,
        "-m",
        "trinity_dagster.cli",
        "convert",
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise dg.Failure(
            f"converting {ckpt} to a Hugging Face directory failed",
            metadata={"stderr": dg.MetadataValue.md(f"```\n{done.stderr[-4000:]}\n```")},
        )


@dg.multi_asset(
    name="sync",
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
    can_subset=False,
    backfill_policy=dg.BackfillPolicy.single_run(),
    pool=ENGINE_POOL,
)
def sync(
    context: dg.AssetExecutionContext, engine: EngineResource
) -> Iterator[dg.AssetMaterialization]:
    """Record (or publish) the weights of each step of the run."""
    for step in run_steps(context):
        info = engine.sync_weight(step)
        yield step_materialization(
            SYNCED,
            step,
            {
                "version": info["version"],
                "path": dg.MetadataValue.path(info["path"]),
                "size_bytes": info["size_bytes"],
            },
        )
