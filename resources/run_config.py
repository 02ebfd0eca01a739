"""The run configuration as a Dagster resource."""

import os
from functools import cache, cached_property

import dagster as dg

from trinity_dagster.config import (
    CONFIG_ENV_VAR,
    ConfigError,
    TrinityConfig,
    load_config,
    run_root_in_use,
)
from trinity_dagster.paths import RunPaths


def config_path_from_env() -> str | None:
    """The YAML file named by `TRINITY_DAGSTER_CONFIG`, or None for the embedded defaults."""
    return os.environ.get(CONFIG_ENV_VAR) or None


def load_run_config(config_path: str | None) -> TrinityConfig:
    """The validated configuration in `config_path` (None: the embedded defaults), read once
    per process while the file (and the working directory, against which the defaults'
    relative paths resolve) is unchanged: the definitions and the resource share it."""
    try:
        stamp = os.stat(config_path).st_mtime_ns if config_path else None
    except OSError:
        stamp = None  # load_config names the missing file
    return _load(config_path, stamp, os.getcwd())


@cache
def _load(config_path: str | None, stamp: int | None, cwd: str) -> TrinityConfig:
    return load_config(config_path)


class RunConfigResource(dg.ConfigurableResource):
    """Loads the run's `TrinityConfig`; every asset reads settings and paths from it."""

    config_path: str | None = None

    @cached_property
    def config(self) -> TrinityConfig:
        """The validated configuration (errors name the file and key path).

        `continue_from_checkpoint: false` on a run root in use is refused: each process of
        the code location would pick its own fresh name; `trinity-dagster run` picks one.
        """
        config = load_run_config(self.config_path)
        if not config.continue_from_checkpoint and run_root_in_use(config):
            raise ConfigError(
                f"continue_from_checkpoint: false and {config.run_root} holds a run already: "
                "`trinity-dagster run -c FILE` starts the fresh run under a new name; under "
                "`dagster dev`, give the config a new name and run_root instead"
            )
        return config

    @property
    def paths(self) -> RunPaths:
        """The run root layout, with the Delta tables where `buffer.tables_root` puts them."""
        return RunPaths.of_config(self.config)
