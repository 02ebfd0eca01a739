"""What `trinity-dagster run` reads from the Dagster instance while it watches a training: new
step materialisations, runs that failed (retried or for good), a failing sensor, the
evaluations and the lineage check."""

from __future__ import annotations

from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.dagster_instance import WILL_RETRY_TAG
from trinity_dagster.graph_names import (
    EVALUATION,
    LOOP_SENSOR,
    ROLLOUTS,
    TRAIN,
)
from trinity_dagster.lineage_check_result import latest_lineage_check
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key

FAILURE_REASON = "dagster/failure_reason"
FAILED_TICKS = 3


def metadata_values(event: Any) -> dict[str, Any]:
    """The metadata of a Dagster materialization or observation as plain values by name."""
    return {name: entry.value for name, entry in event.metadata.items()}


class Progress:
    """Reads the instance: new step materialisations, final failures, the end of training."""

    def __init__(self, instance: Any, config: TrinityConfig) -> None:
        import dagster as dg

        self.dg = dg
        self.instance = instance
        self.config = config
        self.paths = RunPaths.of_config(config)
        self.cursors: dict[str, str | None] = {ROLLOUTS: None, TRAIN: None}
        self.reported_failures: set[str] = set()
        self.reported_retries: set[str] = set()
        self._loop_sensor: tuple[str, str] | None = None  # its origin and selector ids

    def new_lines(self) -> list[str]:
        """One line per explore or train step recorded since the last call, and per run
        that failed and is retried."""
        lines = []
        for asset in self.cursors:
            result = self.instance.fetch_materializations(
                self.dg.AssetKey(asset), limit=1000, cursor=self.cursors[asset], ascending=True
            )
            if result.records:
                self.cursors[asset] = result.cursor
            for record in result.records:
                event = record.asset_materialization
                if event is not None and event.partition is not None:
                    meta = metadata_values(event)
                    lines.append(self._line(asset, int(event.partition), meta))
        return lines + self._retried_runs()

    def _retried_runs(self) -> list[str]:
        """One line per run that failed and that Dagster's run retries start again."""
        dg = self.dg
        failed = self.instance.get_runs(
            filters=dg.RunsFilter(
                statuses=[dg.DagsterRunStatus.FAILURE], tags={WILL_RETRY_TAG: "true"}
            )
        )
        lines = []
        for run in failed:
            if run.run_id not in self.reported_retries:
                self.reported_retries.add(run.run_id)
                error = self._error(run.run_id)
                lines.append(f"{run.job_name} run {run.run_id} failed and is retried: {error}")
        return lines

    def _line(self, asset: str, step: int, meta: dict[str, Any]) -> str:
        head = f"[{step:>3}/{self.config.trainer.total_steps or '?'}]"
        if asset == ROLLOUTS:
            kind = "demonstrations" if meta.get("demonstrations") else "rollouts"
            return (
                f"{head} explore  {kind}: reward {meta.get('reward_mean', float('nan')):.3f}, "
                f"weights v{meta.get('weights_version')}"
            )
        nan = float("nan")
        if meta.get("critic/warmup"):
            parts = ["critic warm-up"]
        else:
            parts = [
                f"pg_loss {meta.get('actor/pg_loss', nan):+.4f}",
                f"entropy {meta.get('actor/entropy', nan):.3f}",
            ]
        if "critic/vf_loss" in meta:
            parts.append(f"vf_loss {meta['critic/vf_loss']:.4f}")
        parts += [
            f"reward {meta.get('critic/rewards/mean', nan):.3f}",
            f"{meta.get('time/step', nan):.2f}s",
        ]
        return f"{head} train    " + ", ".join(parts)

    def sensor_failure(self) -> str | None:
        """The error of the loop's sensor once `FAILED_TICKS` of its ticks failed in a row.

        A sensor that raises on every tick would otherwise leave the run waiting forever; a
        code server that is not reachable yet (the daemon retries it) does not count.
        """
        if self._loop_sensor is None:
            self._loop_sensor = next(
                (
                    (state.instigator_origin_id, state.selector_id)
                    for state in self.instance.all_instigator_state()
                    if state.instigator_name == LOOP_SENSOR
                ),
                None,
            )
            if self._loop_sensor is None:
                return None  # not started yet
        ticks = self.instance.get_ticks(*self._loop_sensor, limit=1)
        tick = ticks[0] if ticks else None
        if tick is None or not tick.is_failure or tick.error is None:
            return None
        if tick.error.cls_name == "DagsterUserCodeUnreachableError":
            return None
        if tick.consecutive_failure_count >= FAILED_TICKS:
            return (
                f"{LOOP_SENSOR} failed {tick.consecutive_failure_count} ticks in a row: "
                f"{tick.error.to_string()}"
            )
        return None

    def final_failure(self) -> str | None:
        """The error of a run that failed and will not be retried, if any."""
        dg = self.dg
        failed = self.instance.get_runs(
            filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE])
        )
        for run in failed:
            if run.run_id in self.reported_failures:
                continue
            step_failure = run.tags.get(FAILURE_REASON) == "STEP_FAILURE"
            if not step_failure and run.tags.get(WILL_RETRY_TAG) != "false":
                continue  # retried by the daemon, or not decided yet
            self.reported_failures.add(run.run_id)
            return f"{run.job_name} run {run.run_id} failed: {self._error(run.run_id)}"
        return None

    def _error(self, run_id: str) -> str:
        dg = self.dg
        for kind in (dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE):
            records = self.instance.get_records_for_run(run_id, of_type=kind).records
            for record in records:
                event = record.event_log_entry.dagster_event
                error = getattr(event.event_specific_data, "error", None)
                if error is not None:
                    return error.to_string()
                if event.message:
                    return event.message
        return "no error recorded (see the run's logs)"

    def run_going(self, job_name: str) -> bool:
        """Whether a run of `job_name` is queued, starting or going."""
        dg = self.dg
        statuses = [
            dg.DagsterRunStatus.QUEUED,
            dg.DagsterRunStatus.NOT_STARTED,
            dg.DagsterRunStatus.STARTING,
            dg.DagsterRunStatus.STARTED,
        ]
        filters = dg.RunsFilter(job_name=job_name, statuses=statuses)
        return bool(self.instance.get_runs(filters=filters, limit=1))

    def evaluation(self, version: int) -> dict[str, Any] | None:
        """The metadata of `evaluation[version]`, once recorded."""
        dg = self.dg
        key = step_key(version)
        records = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(EVALUATION), asset_partitions=[key]),
            limit=1,
        ).records
        if not records or records[0].asset_materialization is None:
            return None
        return metadata_values(records[0].asset_materialization)

    def lineage_check(self, since: float) -> dict[str, Any] | None:
        """`passed` and the metadata of the newest `trained_exactly_once` evaluation made
        after `since` (a time), once there is one."""
        found = latest_lineage_check(self.instance, since)
        if found is None:
            return None
        _, evaluation = found
        return {"passed": evaluation.passed, **metadata_values(evaluation)}

    def rollout_rewards(self) -> list[tuple[int, float, bool]]:
        """(explore step, mean reward, demonstrations?) of every rollouts partition, by step."""
        records = self.instance.fetch_materializations(
            self.dg.AssetKey(ROLLOUTS), limit=10_000
        ).records
        latest: dict[int, tuple[float, bool]] = {}
        for record in sorted(records, key=lambda r: r.storage_id):
            event = record.asset_materialization
            if event is None or event.partition is None:
                continue
            meta = metadata_values(event)
            latest[int(event.partition)] = (
                float(meta["reward_mean"]),
                bool(meta["demonstrations"]),
            )
        return [(step, reward, demo) for step, (reward, demo) in sorted(latest.items())]
