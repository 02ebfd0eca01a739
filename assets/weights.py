"""`checkpoint` and `hf_model`: full checkpoints of a step and their Hugging Face exports.

The trainer loop saves checkpoints as due (in the background) and `rft_loop_sensor`
records each one when its manifest lands. Materialising `checkpoint[N]` from the UI is "save
now": a complete checkpoint of step N is recorded at once; otherwise the running trainer loop
saves step N in the background when it is at N (at its next step boundary, or at once while
it waits for data; a later N waits until the loop gets there) and this run records it when its
manifest lands. A step the engine is past fails at once, naming what can still be saved. With
no trainer loop alive the run has the engine save the step itself. `hf_model[N]` of a kept
checkpoint without an export runs `trinity-dagster convert`, beside training. The op takes
no `engine` pool slot, so it never waits for the end of training.
"""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg

from assets.control import ask_trainer, request_id
from assets.lineage import checkpoint_upstream
from assets.partitions import step_partitions
from assets.step_runs import run_steps, step_materialization
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.checkpoint.layout import HF_SUBDIR, checkpoint_dir
from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint
from trinity_dagster.graph_names import CHECKPOINT, HF_MODEL, TRAIN
from trinity_dagster.handoff import control


def checkpoint_metadata(info: dict[str, Any]) -> dict[str, Any]:
    """Path, size, file count and manifest checksum of a complete checkpoint."""
    return {
        "path": dg.MetadataValue.path(info["path"]),
        "size_bytes": info["size_bytes"],
        "files": info["files"],
        "manifest_sha256": info["manifest_sha256"],
    }


def hf_metadata(hf_dir: Path) -> dict[str, Any]:
    """Path and size of a Hugging Face directory."""
    return {
        "path": dg.MetadataValue.path(str(hf_dir)),
        "size_bytes": sum(p.stat().st_size for p in hf_dir.iterdir() if p.is_file()),
    }


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
            hf = HF_MODEL in selected
            try:
                verify_checkpoint(ckpt, checksums=False)
            except CorruptCheckpointError:  # not saved yet: "save now"
                ask_trainer(context, run_config, "save", step=step, hf=hf)
            info = engine.wrapper().wait_for_checkpoint(step, hf=hf)
            upstream = checkpoint_upstream(run_config.paths, step)
            yield step_materialization(CHECKPOINT, step, {**checkpoint_metadata(info), **upstream})
            control.forget(run_config.paths, request_id(context, "save", step))
            try:
                verify_checkpoint(ckpt)
            except CorruptCheckpointError as err:
                problems.append(f"step {step}: {err}")
        if HF_MODEL in selected:
            hf_dir = ckpt / HF_SUBDIR
            if not hf_dir_written(hf_dir):
                convert_checkpoint(ckpt, hf_dir)
            yield step_materialization(HF_MODEL, step, hf_metadata(hf_dir))
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
