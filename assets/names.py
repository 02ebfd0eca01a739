"""The names of the code location's assets, the one place other modules take them from."""

ROLLOUTS = "rollouts"
EVALUATION = "evaluation"
BATCH = "experience_batch"
TRAIN = "train_step"
SYNCED = "synced_weights"
CHECKPOINT = "checkpoint"
HF_MODEL = "hf_model"
