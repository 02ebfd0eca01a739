"""The run configuration as a Dagster resource."""

import os
from functools import cached_property

import dagster as dg

from trinity_dagster.config import CONFIG_ENV_VAR, TrinityConfig, load_config
from trinity_dagster.paths import RunPaths


def config_path_from_env() -> str | None:
    """The YAML file named by `TRINITY_DAGSTER_CONFIG`, or None for the embedded defaults."""
    return os.environ.get(CONFIG_ENV_VAR) or None


def load_run_config() -> TrinityConfig:
    """The configuration named by the environment, for definitions that depend on it."""
    return load_config(config_path_from_env())


class RunConfigResource(dg.ConfigurableResource):
    """Loads the run's `TrinityConfig`; every asset reads settings and paths from it."""

    config_path: str | None = None

    @cached_property
    def config(self) -> TrinityConfig:
        """The validated configuration (errors name the file and key path)."""
        return load_config(self.config_path)

    @property
    def paths(self) -> RunPaths:
        """The run root layout, with the Delta tables where `buffer.tables_root` puts them."""
        return RunPaths.of_config(self.config)
