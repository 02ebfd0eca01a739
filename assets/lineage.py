"""Lineage in the UI, and the `trained_exactly_once` check.

Dagster forbids a partition depending on an earlier partition of the same asset, so the
graph cannot draw "step N trained on step N-1's weights". Instead each `train_step[N]` and
`checkpoint[N]` names its upstream in its metadata as links the UI follows (the batch, the
parent step, the synced weights that produced the batch's experiences), and each
`experience_batch[N]` carries a data version: the digest of its pinned eids, which
`train_step[N]` records as its input's data version.

`trained_exactly_once` (on `train_step`) proves from the ledger (`trinity_dagster.lineage`)
that every pinned experience was consumed as the sampler allows and none below the cursor was
skipped. `rft_loop_sensor` runs it when training finishes; the UI runs it on demand.
"""

import hashlib
from collections.abc import Sequence
from typing import Any

import dagster as dg

from assets.partitions import step_key
from resources.run_config import RunConfigResource
from trinity_dagster.graph_names import (
    BATCH,
    LINEAGE_CHECK_JOB,
    SYNCED,
    TRAIN,
    TRAINED_EXACTLY_ONCE,
)
from trinity_dagster.lineage.checkpoint_summary import read_summary, write_summary
from trinity_dagster.paths import RunPaths

# the event tags Dagster reads an asset event's data version and its inputs' from
DATA_VERSION_TAG = "dagster/data_version"
INPUT_DATA_VERSION_TAG = "dagster/input_data_version/{}"


def partition_url(asset: str, step: int) -> dg.MetadataValue:
    """A link to partition `step` of `asset` in the UI (relative to the webserver)."""
    return dg.MetadataValue.url(f"/assets/{asset}?view=partitions&partition={step_key(step)}")


def weights_table(counts: dict[int, int]) -> dg.MetadataValue:
    """Experiences per producing weights version, each version linked to its synced weights."""
    rows = [
        f"| [v{v}](/assets/{SYNCED}?view=partitions&partition={step_key(v)}) | {n} |"
        for v, n in sorted(counts.items())
    ]
    return dg.MetadataValue.md("| weights version | experiences |\n|---|---|\n" + "\n".join(rows))


def batch_data_version(eids: Sequence[str]) -> str:
    """The data version of a pinned batch: a digest of its train eids in batch order."""
    return hashlib.sha256("\n".join(eids).encode()).hexdigest()[:16]


def data_version(version: str) -> dict[str, str]:
    """Event tags giving a materialisation the data version `version`."""
    return {DATA_VERSION_TAG: version}


def step_upstream(
    step: int,
    counts: dict[int, int] | None = None,
    batch_version: int | None = None,
) -> dict[str, Any]:
    """`upstream/*` metadata of `train_step[N]`: its batch, its parent step and what is known
    of the batch (its `batches` table version, its producing weights versions)."""
    found: dict[str, Any] = {"upstream/experience_batch": partition_url(BATCH, step)}
    if step > 1:
        found["upstream/parent_step"] = partition_url(TRAIN, step - 1)
    if batch_version is not None:
        found["upstream/batch_table_version"] = batch_version
    if counts:
        found["upstream/weights_versions"] = weights_table(counts)
    return found


def checkpoint_upstream(paths: RunPaths, step: int) -> dict[str, Any]:
    """`upstream/*` and `lineage/*` metadata of `checkpoint[N]`, from the summary the trainer
    stored when it saved N (computed from the ledger if there is none)."""
    summary = read_summary(paths, step) or write_summary(paths, step)
    gaps = summary["gaps"]
    return {
        "upstream/train_step": partition_url(TRAIN, step),
        "upstream/weights_versions": weights_table(summary["by_weights_version"]),
        "lineage/steps": f"1..{step} from the initial model"
        + (f"; gaps at {gaps}" if gaps else ", no gap"),
        "lineage/experiences_trained": summary["experiences_trained"],
        "lineage/staleness_max": summary["staleness_max"],
    }


@dg.asset_check(
    asset=TRAIN,
    name=TRAINED_EXACTLY_ONCE,
    description=(
        "Every pinned experience is in exactly one step (or as often as buffer.reuse_limit "
        "allows), none below the sampler's cursor was skipped, every trained step has its "
        "record: across kills and resumes."
    ),
)
def trained_exactly_once(run_config: RunConfigResource) -> dg.AssetCheckResult:
    """The proof over the whole run, from the lineage ledger."""
    return dg.AssetCheckResult(**trained_once_verdict(run_config))


def trained_once_evaluation(run_config: RunConfigResource) -> dg.AssetCheckEvaluation:
    """`trained_exactly_once`'s result as an event another run logs (the built-in explorer's,
    once training finished)."""
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey(TRAIN),
        check_name=TRAINED_EXACTLY_ONCE,
        **trained_once_verdict(run_config),
    )


def trained_once_verdict(run_config: RunConfigResource) -> dict[str, Any]:
    """`passed`, `description` (the problems, None if none) and `metadata` of the proof."""
    from trinity_dagster.lineage.verify import verify_trained_once  # pyarrow: not in the sensor

    verdict = verify_trained_once(run_config.paths, run_config.config.buffer.reuse_limit)
    counts = {name: value for name, value in verdict.counts.items() if name != "cursor"}
    return {
        "passed": verdict.passed,
        "description": "; ".join(verdict.problems) or None,
        "metadata": {**counts, "problems": "; ".join(verdict.problems) or "none"},
    }


lineage_check_job = dg.define_asset_job(
    LINEAGE_CHECK_JOB,
    selection=dg.AssetSelection.checks(trained_exactly_once),
    executor_def=dg.in_process_executor,
    description="Run trained_exactly_once over the whole run.",
)
