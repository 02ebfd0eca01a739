"""Drive the RFT loop through Dagster in one process, for `trinity-dagster demo` and `run`.

The driver does what the Dagster daemon does with this graph, without its polling delays:
it evaluates the graph's sensors (rollouts, data, sync, save) against the run's instance,
adds the partitions they ask for, and executes the runs they request, in process, with their
run keys. Every run, materialisation and check lands in the instance, so `dagster dev` on
the same `DAGSTER_HOME` shows the whole history afterwards. Sensor cursors are kept in
`logs/driver_cursors.json`, so an interrupted drive continues where it stopped.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from assets.definitions import defs
from assets.explore import rollouts_sensor
from assets.partitions import step_key, step_partitions
from assets.sensors import data_sensor, save_sensor, sync_sensor
from resources.run_config import RunConfigResource

SENSORS = (rollouts_sensor, data_sensor, sync_sensor, save_sensor)
RUN_KEY_TAG = "dagster/run_key"
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
SENSOR_TAG = "dagster/sensor_name"


class DriveStalled(RuntimeError):
    """No sensor requested anything for too long before the run was complete."""


@dataclass
class LaunchedRun:
    """One run the driver executed."""

    sensor: str
    job: str
    partition: str | None
    run_id: str
    seconds: float


@dataclass
class Driver:
    """Evaluates sensors and executes the runs they request until `done()` says so."""

    instance: dg.DagsterInstance
    run_config: RunConfigResource
    cursor_file: Path
    on_run: Callable[[LaunchedRun], None] = lambda run: None
    cursors: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cursor_file.is_file():
            self.cursors = json.loads(self.cursor_file.read_text())

    def _save_cursors(self) -> None:
        self.cursor_file.parent.mkdir(parents=True, exist_ok=True)
        self.cursor_file.write_text(json.dumps(self.cursors))

    def _already_launched(self, run_key: str) -> bool:
        runs = self.instance.get_runs(filters=dg.RunsFilter(tags={RUN_KEY_TAG: run_key}), limit=1)
        return any(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)

    def tick(self) -> tuple[int, list[str]]:
        """Evaluate every sensor once; returns the runs launched and the skip reasons."""
        launched, skipped = 0, []
        for sensor in SENSORS:
            context = dg.build_sensor_context(
                instance=self.instance,
                cursor=self.cursors.get(sensor.name),
                sensor_name=sensor.name,
                definitions=defs,
                resources={"run_config": self.run_config},
            )
            result = sensor(context)
            if isinstance(result, dg.SkipReason):
                skipped.append(f"{sensor.name}: {result.skip_message}")
                continue
            for request in result.dynamic_partitions_requests or []:
                self.instance.add_dynamic_partitions(
                    request.partitions_def_name, list(request.partition_keys)
                )
            for request in result.run_requests or []:
                if request.run_key and self._already_launched(request.run_key):
                    continue
                self._execute(sensor, request)
                launched += 1
            if result.cursor is not None:
                self.cursors[sensor.name] = result.cursor
                self._save_cursors()
        return launched, skipped

    def _execute(self, sensor: dg.SensorDefinition, request: dg.RunRequest) -> None:
        job_name = request.job_name or sensor.job_name
        job = defs.resolve_job_def(job_name)
        tags = {**request.tags, SENSOR_TAG: sensor.name}
        if request.run_key:
            tags[RUN_KEY_TAG] = request.run_key
        started = time.perf_counter()
        result = job.execute_in_process(
            run_config=QUIET_CONSOLE,
            instance=self.instance,
            partition_key=request.partition_key,
            tags=tags,
        )
        self.on_run(
            LaunchedRun(
                sensor.name,
                job_name,
                request.partition_key,
                result.run_id,
                time.perf_counter() - started,
            )
        )

    def drive(self, done: Callable[[], bool], stall_timeout_s: float = 300.0) -> None:
        """Tick until `done()`; raise `DriveStalled` with the skip reasons if nothing moves."""
        idle_since = time.monotonic()
        while not done():
            launched, skipped = self.tick()
            if launched:
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since > stall_timeout_s:
                raise DriveStalled(
                    "no progress for {:.0f} s; sensors say: {}".format(
                        stall_timeout_s, "; ".join(skipped)
                    )
                )
            time.sleep(0.5)


def materialize_step(
    instance: dg.DagsterInstance, job_name: str, step: int
) -> dg.ExecuteInProcessResult:
    """Run one job of the graph for one step (its partition is added first)."""
    key = step_key(step)
    instance.add_dynamic_partitions(step_partitions.name, [key])
    return defs.resolve_job_def(job_name).execute_in_process(
        run_config=QUIET_CONSOLE, instance=instance, partition_key=key
    )


def rollout_rewards(instance: dg.DagsterInstance) -> list[tuple[int, float, bool]]:
    """(explore step, mean reward, demonstrations?) of every rollouts partition, by step."""
    records = instance.fetch_materializations(dg.AssetKey("rollouts"), limit=10_000).records
    latest: dict[int, tuple[float, bool]] = {}
    for record in sorted(records, key=lambda r: r.storage_id):
        event = record.asset_materialization
        if event is None or event.partition is None:
            continue
        meta = {name: value.value for name, value in event.metadata.items()}
        latest[int(event.partition)] = (float(meta["reward_mean"]), bool(meta["demonstrations"]))
    return [(step, reward, demo) for step, (reward, demo) in sorted(latest.items())]
