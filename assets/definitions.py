"""The `Definitions` of the code location that `workspace.yaml` loads."""

from __future__ import annotations

import dagster as dg

from resources.run_config import RunConfigResource, config_path_from_env

defs = dg.Definitions(
    resources={"run_config": RunConfigResource(config_path=config_path_from_env())},
)
