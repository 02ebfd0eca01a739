"""Jobs over the step-partitioned assets. Each runs its ops in the run's own process
(`in_process_executor`): a long-lived loop needs no second process per step."""

import dagster as dg

from trinity_dagster.graph_names import (
    BATCH,
    CHECKPOINT,
    EVALUATION,
    EVALUATION_JOB,
    HF_MODEL,
    ROLLOUTS,
    ROLLOUTS_JOB,
    TRAIN,
    TRAIN_JOB,
)

train_job = dg.define_asset_job(
    TRAIN_JOB,
    selection=[BATCH, TRAIN],
    executor_def=dg.in_process_executor,
    description="The trainer loop over a range of steps: pin, train, sync and save as due.",
)
save_job = dg.define_asset_job(
    "save_job",
    selection=[CHECKPOINT, HF_MODEL],
    executor_def=dg.in_process_executor,
    description="Write (or record) the full checkpoint of step N and its HF export.",
)
rollouts_job = dg.define_asset_job(
    ROLLOUTS_JOB,
    selection=[ROLLOUTS],
    executor_def=dg.in_process_executor,
    description="The built-in explorer loop over a range of explore steps.",
)
evaluation_job = dg.define_asset_job(
    EVALUATION_JOB,
    selection=[EVALUATION],
    executor_def=dg.in_process_executor,
    description="Evaluate weights version N on the held-out task set.",
)
