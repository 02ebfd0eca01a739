"""The Megatron trainer as a Dagster resource: the engine service's `TrainEngineWrapper`.

Each Dagster run attaches to the run root's engine service through
`trinity_dagster.trainer.ServiceEngineWrapper`, which starts the service if none answers
(the embedded default) and, if the service dies during a command, starts it again (it
resumes from the newest complete checkpoint) and repeats the command once. An engine error
fails the Dagster step with the engine's message and traceback text.
"""

import dagster as dg
from pydantic import PrivateAttr

from resources.run_config import RunConfigResource
from trinity_dagster.trainer import ServiceEngineWrapper


class EngineResource(dg.ConfigurableResource):
    """Hands out the run's engine wrapper (one connection pool per run)."""

    run_config: dg.ResourceDependency[RunConfigResource]
    autostart: bool = True
    _wrapper: ServiceEngineWrapper | None = PrivateAttr(default=None)

    def wrapper(self) -> ServiceEngineWrapper:
        """The engine of the run's configuration, connected on first use."""
        if self._wrapper is None:
            self._wrapper = ServiceEngineWrapper(self.run_config.config, autostart=self.autostart)
        return self._wrapper

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Close the run's connection."""
        if self._wrapper is not None:
            self._wrapper.close()
            self._wrapper = None
