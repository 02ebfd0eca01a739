"""Jobs over the step-partitioned assets. Each runs its ops in the run's own process
(`in_process_executor`): a long-lived loop needs no second process per step."""

import dagster as dg

train_job = dg.define_asset_job(
    "train_job",
    selection=["experience_batch", "train_step"],
    executor_def=dg.in_process_executor,
    description="The trainer loop over a range of steps: pin, train, sync and save as due.",
)
save_job = dg.define_asset_job(
    "save_job",
    selection=["checkpoint", "hf_model"],
    executor_def=dg.in_process_executor,
    description="Write (or record) the full checkpoint of step N and its HF export.",
)
rollouts_job = dg.define_asset_job(
    "rollouts_job",
    selection=["rollouts"],
    executor_def=dg.in_process_executor,
    description="The built-in explorer loop over a range of explore steps.",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job",
    selection=["evaluation"],
    executor_def=dg.in_process_executor,
    description="Evaluate weights version N on the held-out task set.",
)
