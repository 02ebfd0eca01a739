"""Jobs over the step-partitioned assets: train, sync, save."""

import dagster as dg

train_job = dg.define_asset_job(
    "train_job",
    selection=["experience_batch", "train_step"],
    description="Pin step N's experiences and train step N.",
)
sync_job = dg.define_asset_job(
    "sync_job",
    selection=["synced_weights"],
    description="Publish (or record) the weights of step N for explorers.",
)
save_job = dg.define_asset_job(
    "save_job",
    selection=["checkpoint"],
    description="Write (or record) the full checkpoint of step N.",
)
save_with_hf_job = dg.define_asset_job(
    "save_with_hf_job",
    selection=["checkpoint", "hf_model"],
    description="Write (or record) the full checkpoint of step N and its HF export.",
)
rollouts_job = dg.define_asset_job(
    "rollouts_job",
    selection=["rollouts"],
    description="Explore step E with the built-in explorer.",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job",
    selection=["evaluation"],
    description="Evaluate weights version N on the held-out task set.",
)
