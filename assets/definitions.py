"""The `Definitions` of the code location that `workspace.yaml` loads."""

import dagster as dg

from assets.automation import build_rft_loop_sensor, build_schedules
from assets.control import pause_training, resume_training, stop_training
from assets.experiences import experience_schema, experiences
from assets.explore import evaluation, rollouts
from assets.jobs import evaluation_job, rollouts_job, save_job, train_job
from assets.lineage import lineage_check_job, trained_exactly_once
from assets.maintenance import checkpoint_retention_job, delta_maintenance_job
from assets.sync import publish
from assets.training import train
from assets.weights import save
from resources.engine import EngineResource
from resources.run_config import RunConfigResource, config_path_from_env, load_run_config

run_config = RunConfigResource(config_path=config_path_from_env())
settings = load_run_config(run_config.config_path).dagster  # the one read of the config file

defs = dg.Definitions(
    assets=[experiences, rollouts, train, publish, save, evaluation],
    asset_checks=[experience_schema, trained_exactly_once],
    jobs=[
        rollouts_job,
        evaluation_job,
        train_job,
        save_job,
        delta_maintenance_job,
        checkpoint_retention_job,
        lineage_check_job,
        pause_training,
        resume_training,
        stop_training,
    ],
    sensors=[build_rft_loop_sensor(settings)],
    schedules=build_schedules(settings),
    resources={"run_config": run_config, "engine": EngineResource(run_config=run_config)},
)
