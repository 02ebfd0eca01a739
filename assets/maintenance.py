"""Maintenance: Delta ledger update, compaction, vacuum and log clean-up (on the schedule, and
launched by `rft_loop_sensor` every `dagster.maintenance_every_steps` steps while training),
checkpoint retention (on the schedule)."""

from typing import Any

import dagster as dg

from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint import retention
from trinity_dagster.checkpoint.rules import sft_model_step
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths


def maintain(config: TrinityConfig) -> dict[str, Any]:
    """Ledger update, compaction, vacuum, log clean-up; what each did.

    Pinned batches stay replayable (they are stored in `batches`), and the ledger has read
    every commit's metadata before the log clean-up deletes old commit files. Vacuum uses
    `dagster.vacuum_retention_hours`, which overrides Delta's minimum.
    """
    from trinity_dagster.buffer.maintenance import clean_logs, compact, vacuum
    from trinity_dagster.lineage.ledger import update_ledger

    return {
        "ledger": update_ledger(RunPaths.of_config(config)),
        "compacted": compact(config),
        "vacuumed": vacuum(
            config,
            retention_hours=config.dagster.vacuum_retention_hours,
            enforce_retention_duration=False,
        ),
        "log_files_left": clean_logs(config),
    }


@dg.op(
    description="Bring the lineage ledger up to date, then compact, vacuum and clean the logs "
    "of the experience, batch, quarantine and ledger tables."
)
def maintain_delta_tables(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """`maintain` the run's tables."""
    done = maintain(run_config.config)
    context.log.info("; ".join(f"{what}: {value}" for what, value in done.items()))


@dg.op(description="Delete checkpoints beyond trainer.max_checkpoints_to_keep.")
def prune_old_checkpoints(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """Retention counted from what is on disk; never the newest checkpoint that verifies,
    nor the SFT model's."""
    config = run_config.config
    deleted = retention.prune_checkpoints(
        run_config.paths,
        config.trainer.max_checkpoints_to_keep,
        keep_step=sft_model_step(config),
    )
    context.log.info(f"deleted checkpoints: {deleted or 'none'}")


@dg.job(description="Delta maintenance: ledger update, compaction, vacuum, log clean-up.")
def delta_maintenance_job() -> None:
    maintain_delta_tables()


@dg.job(description="Checkpoint retention.")
def checkpoint_retention_job() -> None:
    prune_old_checkpoints()
