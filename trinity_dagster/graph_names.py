"""The names of the code location's assets, checks, jobs, sensor and run tags: the one place
the code location (`assets/`) and the library (`trinity-dagster run`, benchmarks) take them
from. No dagster import."""

# assets
ROLLOUTS = "rollouts"
EVALUATION = "evaluation"
BATCH = "experience_batch"
TRAIN = "train_step"
SYNCED = "synced_weights"
CHECKPOINT = "checkpoint"
HF_MODEL = "hf_model"

# asset checks (on `train_step`)
TRAINED_EXACTLY_ONCE = "trained_exactly_once"

# jobs the sensor launches
TRAIN_JOB = "train_job"
ROLLOUTS_JOB = "rollouts_job"
EVALUATION_JOB = "evaluation_job"
LINEAGE_CHECK_JOB = "lineage_check_job"

# the sensor
LOOP_SENSOR = "rft_loop_sensor"

# run tags
FINISHED_TAG = "trinity/training_finished"  # step@time of the end a lineage check is for
MAINTAINED_TAG = "trinity/maintenance_at_step"  # the train step a maintenance run was for
UNTIL_DATA_ENDS_TAG = "trinity/until_data_ends"  # a run that trains until the data ends
