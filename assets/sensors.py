"""The sensor that keeps the RFT loop going and records what happens in the background.

`rft_loop_sensor` is one sensor, so the daemon pays its per-evaluation cost (a code-server
call, an instance, tick records) once per interval, not once per job: with four sensors that
cost took about an eighth of a core, beside a loop that keeps both cores busy. Its parts:
- `trainer_request`: while training is neither finished nor paused (`pause_training`),
  keeps one long-lived `train_job` run going over the next `dagster.steps_per_run` steps
  (the trainer loop, waiting for data itself), adding their partitions as it launches it;
- `explorer_request` (`dagster.builtin_explorer`): likewise one `rollouts_job` run of the
  built-in explorer loop;
- `checkpoint_records`: records `checkpoint[N]` and `hf_model[N]` once a background save's
  manifest lands (and `synced_weights[N]`, when the manifest says the export serves as the
  sync, once the weights marker names N), without a run, holding no pool slot; a checkpoint
  that a user's run asked for ("save now") is left to that run while it is alive;
- `weights_versions`: adds a `weights_version` partition for each published or kept
  version, so the UI offers it for `evaluation`;
- `evaluation_requests`: once training finished, evaluates the initial weights, the SFT
  warm-up's last (checkpointed) and the final weights, those the built-in explorer's run
  did not score itself (`assets.explore.score_finished_run`) once it ended;
- `lineage_check_request`: likewise runs `trained_exactly_once` once training finished;
- `maintenance_request`: while training, a `delta_maintenance_job` run every
  `dagster.maintenance_every_steps` steps (ledger update, compaction, log clean-up), so the
  Delta tables cost the same per step at step 50,000 as at step 1.
A run killed with its worker is retried by Dagster's run retries (see
`trinity_dagster.dagster_instance`) or, if interrupted, started again by the sensor; a
trainer run that failed on an error of the loop is not relaunched: the skip reason then says
why it waits. Run keys (job, range, attempt) make every request unique.
"""

import contextlib
import re
import time
from collections.abc import Mapping

import dagster as dg
import psutil

from assets.control import run_of_request
from assets.explore import weights_partitions
from assets.jobs import evaluation_job, rollouts_job, train_job
from assets.lineage import checkpoint_upstream, lineage_check_job
from assets.maintenance import delta_maintenance_job
from assets.partitions import (
    STEP_PARTITIONS,
    WEIGHTS_PARTITIONS,
    step_key,
    step_of,
    step_partitions,
)
from assets.weights import checkpoint_metadata, hf_metadata
from resources.run_config import RunConfigResource
from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    latest_weights_version,
    scan_step_dirs,
    weights_versions_on_disk,
)
from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint
from trinity_dagster.checkpoint.rules import explore_steps_needed
from trinity_dagster.dagster_instance import WILL_RETRY_TAG
from trinity_dagster.explorer.eval_versions import versions_to_evaluate
from trinity_dagster.graph_names import (
    CHECKPOINT,
    EVALUATION,
    FINISHED_TAG,
    HF_MODEL,
    MAINTAINED_TAG,
    ROLLOUTS,
    SYNCED,
    TRAIN,
    TRAINED_EXACTLY_ONCE,
    UNTIL_DATA_ENDS_TAG,
)
from trinity_dagster.handoff import control
from trinity_dagster.handoff.end_of_data import end_of_data
from trinity_dagster.handoff.heartbeat import BUILTIN_EXPLORER_ID, seconds_since_beat
from trinity_dagster.handoff.trainer_state import (
    TrainerState,
    finished_training,
    read_trainer_state,
)
from trinity_dagster.lineage_check_result import latest_lineage_check

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"
MAX_ATTEMPTS = 3
WORKER_PID = re.compile(r"Started process for run \(pid: (\d+)\)")
BUSY = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


class NewestSteps:
    """The highest materialised step partition of an asset, read incrementally.

    The first call in a process reads every materialised partition; later calls only those
    materialised since (by storage id), so a sensor evaluation costs the same at step 50,000
    as at step 1. The daemon evaluates the sensor in a long-lived code server, with a new
    instance object each time: what was read is kept by the instance's directory.
    """

    def __init__(self) -> None:
        # (instance directory, asset) -> (storage id read up to, newest step)
        self._read: dict[tuple[str, str], tuple[int, int]] = {}

    def __call__(self, instance: dg.DagsterInstance, asset: str) -> int:
        key, where = dg.AssetKey(asset), (instance.root_directory, asset)
        latest = instance.fetch_materializations(key, limit=1, ascending=False).records
        if not latest:
            self._read.pop(where, None)
            return 0
        cursor, newest = self._read.get(where, (None, 0))
        if newest and not recorded_partitions(instance, asset, {step_key(newest)}):
            cursor, newest = None, 0  # its materialisations were wiped: read them all again
        top = latest[0].storage_id
        if cursor is None or top > cursor:
            found = instance.get_materialized_partitions(key, after_cursor=cursor)
            newest = max([newest, *(step_of(partition) for partition in found)])
        self._read[where] = (top, newest)
        return newest


newest_step = NewestSteps()


def recorded_partitions(instance: dg.DagsterInstance, asset: str, keys: set[str]) -> set[str]:
    """Which of the partitions `keys` of `asset` are materialised (a query bounded by them)."""
    if not keys:
        return set()
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(
        dg.AssetKey(asset), dg.DagsterEventType.ASSET_MATERIALIZATION, keys
    )
    return set(latest)


def training_finished(run_config: RunConfigResource) -> TrainerState | None:
    """The trainer's state if it finished this configuration's training."""
    return finished_training(run_config.paths, run_config.config.trainer.total_steps)


def busy_run(instance: dg.DagsterInstance, job_name: str) -> dg.DagsterRun | None:
    """A run of `job_name` that is queued, starting, going or being cancelled, if any; a
    started run whose worker process is gone (killed with `dagster dev`) does not count."""
    runs = instance.get_runs(filters=dg.RunsFilter(job_name=job_name, statuses=list(BUSY)))
    for run in runs:
        if run.status != dg.DagsterRunStatus.STARTED or worker_gone(instance, run) is None:
            return run
    return None


def worker_gone(instance: dg.DagsterInstance, run: dg.DagsterRun) -> int | None:
    """The pid of a started run's worker process if that process is gone, else None.

    The default run launcher starts workers on this machine; a worker killed together with
    `dagster dev` or the daemon leaves its run STARTED, which nothing else notices. Under
    another launcher (Kubernetes, Docker) the pid names a process on another machine, and
    Dagster's run monitoring checks the worker's health instead: None.
    """
    pid = worker_pid(instance, run)
    if pid is None:
        return None
    try:
        alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    return None if alive else pid


def worker_pid(instance: dg.DagsterInstance, run: dg.DagsterRun) -> int | None:
    """The pid of a run's worker process on this machine (None under another launcher)."""
    if not isinstance(instance.run_launcher, dg.DefaultRunLauncher):
        return None
    records = instance.get_records_for_run(
        run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
    ).records
    pids = [
        int(match.group(1))
        for record in records
        if (match := WORKER_PID.search(record.event_log_entry.message or ""))
    ]
    return pids[-1] if pids else None


def end_hung_explorer(instance: dg.DagsterInstance, run_config: RunConfigResource) -> str | None:
    """End the built-in explorer's started run if its loop made no progress (no heartbeat,
    `explorer.heartbeat`) for `explorer.step_timeout_s`; returns what was done, or None.

    Its worker is killed and the run reported failed, so it is started again from its step
    like a crashed one.
    """
    runs = instance.get_runs(
        filters=dg.RunsFilter(job_name=rollouts_job.name, statuses=[dg.DagsterRunStatus.STARTED]),
        limit=1,
    )
    if not runs:
        return None
    run, limit = runs[0], run_config.config.explorer.step_timeout_s
    record = instance.get_run_record_by_id(run.run_id)
    quiet = [seconds_since_beat(run_config.paths, BUILTIN_EXPLORER_ID)]
    if record is not None and record.start_time is not None:
        quiet.append(time.time() - record.start_time)  # a beat of an earlier run is older
    known = [q for q in quiet if q is not None]
    if not known or min(known) <= limit:
        return None
    pid = worker_pid(instance, run)
    if pid is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    why = (
        f"the explorer loop made no progress for {min(known):.0f} s "
        f"(explorer.step_timeout_s {limit:g}); its worker (pid {pid}) was killed"
    )
    instance.report_run_failed(run, why)
    return f"{rollouts_job.name} run {run.run_id} hung: {why}"


def launch_attempt(
    instance: dg.DagsterInstance, job_name: str, first: int, loop_error: str | None
) -> int | str:
    """The attempt number of a new run of `job_name` from step `first`, or why none starts.

    A started run whose worker died is marked failed here (nothing else notices it). A failed
    run is left to Dagster's run retries when they take it; a run that failed because the
    loop itself raised (`loop_error`) is not started again; one that was interrupted or
    killed is, at most `MAX_ATTEMPTS` times from the same step.
    """
    runs = instance.get_runs(filters=dg.RunsFilter(job_name=job_name), limit=1)
    if not runs:
        return 0
    last = runs[0]
    if last.status == dg.DagsterRunStatus.STARTED and (pid := worker_gone(instance, last)):
        instance.report_run_failed(last, f"the run worker (pid {pid}) is gone")
        return f"{job_name} run {last.run_id} lost its worker (pid {pid})"
    if last.status in BUSY:
        return f"{job_name} run {last.run_id} is {last.status.value.lower()}"
    if last.status == dg.DagsterRunStatus.FAILURE:
        will_retry = last.tags.get(WILL_RETRY_TAG)
        if will_retry is None and instance.run_retries_enabled:
            return f"{job_name} run {last.run_id} failed; waiting for Dagster's retry decision"
        if will_retry == "true":
            return f"{job_name} run {last.run_id} failed and will be retried"
        if loop_error is not None:
            return (
                f"{job_name} run {last.run_id} failed: {loop_error}; fix the cause and launch "
                "the remaining steps again (or re-execute the run)"
            )
    failed = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=job_name,
            statuses=[dg.DagsterRunStatus.FAILURE],
            tags={RANGE_START: step_key(first)},
        )
    )
    if len(failed) >= MAX_ATTEMPTS:
        return f"{len(failed)} {job_name} runs from step {first} failed; see their logs"
    return len(failed)


def ranged_request(job_name: str, first: int, last: int | None, attempt: int) -> dg.SensorResult:
    """One run of job `job_name` over steps first..last, with their partitions added first.

    `last` None: an open-ended run (`trainer.total_steps` unset) from step `first` on, which
    adds the partitions of later steps as it records them.
    """
    keys = [step_key(step) for step in range(first, (last or first) + 1)]
    tags = {RANGE_START: step_key(first), RANGE_END: step_key(last or first)}
    if last is None:
        tags[UNTIL_DATA_ENDS_TAG] = "true"
    end = step_key(last) if last is not None else "end"
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=f"{job_name}-{step_key(first)}-{end}-{attempt}",
                job_name=job_name,
                tags=tags,
            )
        ],
        dynamic_partitions_requests=[step_partitions.build_add_request(keys)],
    )


def window_end(first: int, last: int | None, run_config: RunConfigResource) -> int | None:
    """The last step of a run from `first`: `dagster.steps_per_run` steps, at most `last`
    (None: open-ended, when `last` is None)."""
    if last is None:
        return None
    return min(last, first + run_config.config.dagster.steps_per_run - 1)


def trainer_request(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """A trainer run over next..total_steps (from next on until the data ends when
    `total_steps` is unset) unless one runs, training finished or it is paused."""
    finished = training_finished(run_config)
    if finished is not None:
        return dg.SkipReason(f"training finished at step {finished.step}: {finished.reason}")
    paused = control.paused_by(run_config.paths)
    if paused is not None:
        return dg.SkipReason(f"training is paused (by run {paused}); launch resume_training")
    total = run_config.config.trainer.total_steps
    first = newest_step(instance, TRAIN) + 1
    state = read_trainer_state(run_config.paths)
    loop_error = state.reason if state is not None and state.state == "failed" else None
    attempt = launch_attempt(instance, train_job.name, first, loop_error)
    if isinstance(attempt, str):
        return dg.SkipReason(attempt)
    return ranged_request(train_job.name, first, window_end(first, total, run_config), attempt)


def explorer_request(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """A built-in explorer run over next..needed unless one runs or exploring ended."""
    ended = end_of_data(run_config.paths)
    if ended is not None:
        return dg.SkipReason(f"the explorers ended: {ended}")
    finished = training_finished(run_config)
    if finished is not None:
        return dg.SkipReason(f"training finished at step {finished.step}")
    hung = end_hung_explorer(instance, run_config)
    if hung is not None:
        return dg.SkipReason(hung)
    needed = explore_steps_needed(run_config.config)  # None: until the task set is used up
    first = newest_step(instance, ROLLOUTS) + 1
    if needed is not None and first > needed:
        return dg.SkipReason(f"all {needed} explore steps are done")
    attempt = launch_attempt(instance, rollouts_job.name, first, None)
    if isinstance(attempt, str):
        return dg.SkipReason(attempt)
    return ranged_request(rollouts_job.name, first, window_end(first, needed, run_config), attempt)


def checkpoint_records(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """Materialisations of complete checkpoints not recorded yet, without a run.

    A checkpoint whose save serves as the sync gets `synced_weights[N]` once the weights
    marker names N, which the trainer moves just after the checkpoint is complete: until then
    it is looked at again on every tick.
    """
    paths = run_config.paths
    entries = [entry for entry in scan_step_dirs(paths.checkpoints) if entry.kind == "final"]
    keys = {step_key(entry.step) for entry in entries}
    recorded = {
        asset: recorded_partitions(instance, asset, keys)
        for asset in (CHECKPOINT, HF_MODEL, SYNCED)
    }
    published = latest_weights_version(paths) or 0
    asked = asked_by_live_runs(instance, run_config)
    events: list[dg.AssetMaterialization] = []
    for entry in entries:
        key = step_key(entry.step)
        if entry.step in asked or not instance.has_dynamic_partition(STEP_PARTITIONS, key):
            continue
        if key in recorded[CHECKPOINT] and (
            key in recorded[SYNCED] or not hf_dir_written(entry.path / HF_SUBDIR)
        ):
            continue
        try:
            manifest = verify_checkpoint(entry.path, checksums=False)
        except CorruptCheckpointError:
            continue  # still being written, or damaged: `checkpoint_complete` says which
        events += checkpoint_events(entry.step, manifest, recorded, published, run_config)
    if not events:
        return dg.SkipReason("no new complete checkpoint")
    return dg.SensorResult(asset_events=events)


def asked_by_live_runs(instance: dg.DagsterInstance, run_config: RunConfigResource) -> set[int]:
    """Steps whose checkpoint a run that is still going asked for: that run records them."""
    asked = set()
    for step, request_ids in control.open_save_steps(run_config.paths).items():
        for request_id in request_ids:
            run = instance.get_run_by_id(run_of_request(request_id))
            if run is not None and run.status in BUSY:
                asked.add(step)
    return asked


def checkpoint_events(
    step: int,
    manifest,
    recorded: Mapping[str, set[str]],
    published: int,
    run_config: RunConfigResource,
) -> list[dg.AssetMaterialization]:
    """`checkpoint[N]`, `hf_model[N]` and `synced_weights[N]`, those that apply and are due."""
    paths = run_config.paths
    key = step_key(step)
    ckpt = checkpoint_dir(paths, step)
    events = []
    if key not in recorded[CHECKPOINT]:
        info = {
            "path": str(ckpt),
            "size_bytes": sum(entry.size for entry in manifest.files),
            "files": len(manifest.files),
            "manifest_sha256": manifest.digest(),
        }
        metadata = {**checkpoint_metadata(info), **checkpoint_upstream(paths, step)}
        events.append(dg.AssetMaterialization(CHECKPOINT, partition=key, metadata=metadata))
    hf_dir = ckpt / HF_SUBDIR
    if hf_dir_written(hf_dir):
        if key not in recorded[HF_MODEL]:
            events.append(
                dg.AssetMaterialization(HF_MODEL, partition=key, metadata=hf_metadata(hf_dir))
            )
        if manifest.serves_as_sync and published >= step and key not in recorded[SYNCED]:
            events.append(
                dg.AssetMaterialization(
                    SYNCED,
                    partition=key,
                    metadata={
                        "version": step,
                        "path": dg.MetadataValue.path(str(hf_dir)),
                        "size_bytes": hf_metadata(hf_dir)["size_bytes"],
                        "from_checkpoint": True,
                    },
                )
            )
    return events


def weights_versions(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """`weights_version` partitions for the versions on disk, so that the UI offers each
    published or kept version for `evaluation` without a partition added by hand."""
    versions = weights_versions_on_disk(run_config.paths)
    new = [
        step_key(v)
        for v in versions
        if not instance.has_dynamic_partition(WEIGHTS_PARTITIONS, step_key(v))
    ]
    if not new:
        return dg.SkipReason("every weights version on disk has its partition")
    return dg.SensorResult(dynamic_partitions_requests=[weights_partitions.build_add_request(new)])


def evaluation_requests(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """`evaluation[v]` of the initial, the SFT warm-up's last and the final weights, once each.

    They wait for the end of training, so they never take the CPU from the loop, and for the
    built-in explorer's run, which scores them itself when training finished; a run each
    for what it left.
    """
    if training_finished(run_config) is None:
        return dg.SkipReason("waiting for training to finish")
    explorer = busy_run(instance, rollouts_job.name)
    if explorer is not None:
        return dg.SkipReason(f"{rollouts_job.name} run {explorer.run_id} scores the run")
    published = latest_weights_version(run_config.paths) or 0
    versions = versions_to_evaluate(run_config.config, run_config.paths, published)
    done = instance.get_materialized_partitions(dg.AssetKey(EVALUATION))
    wanted = [step_key(v) for v in versions if step_key(v) not in done]
    if not wanted:
        return dg.SkipReason(f"weights {versions} are evaluated")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(run_key=f"eval-{key}", job_name=evaluation_job.name, partition_key=key)
            for key in wanted
        ],
        dynamic_partitions_requests=[weights_partitions.build_add_request(wanted)],
    )


def lineage_check_request(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """One `trained_exactly_once` run each time training finishes, unless the built-in
    explorer's run (which checks it itself then) is going or checked it since."""
    finished = training_finished(run_config)
    if finished is None:
        return dg.SkipReason("waiting for training to finish")
    explorer = busy_run(instance, rollouts_job.name)
    if explorer is not None:
        return dg.SkipReason(f"{rollouts_job.name} run {explorer.run_id} checks lineage")
    checked = latest_lineage_check(instance, finished.updated_at)
    if checked is not None:
        return dg.SkipReason(f"{TRAINED_EXACTLY_ONCE} ran in {checked[0]}")
    tags = {FINISHED_TAG: f"{finished.step}@{finished.updated_at}"}
    done = instance.get_runs(
        filters=dg.RunsFilter(job_name=lineage_check_job.name, tags=tags), limit=1
    )
    if done:
        return dg.SkipReason(f"{TRAINED_EXACTLY_ONCE} ran in {done[0].run_id}")
    request = dg.RunRequest(
        run_key=f"{TRAINED_EXACTLY_ONCE}-{tags[FINISHED_TAG]}",
        job_name=lineage_check_job.name,
        tags=tags,
    )
    return dg.SensorResult(run_requests=[request])


def maintenance_request(
    instance: dg.DagsterInstance, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """A `delta_maintenance_job` run once `dagster.maintenance_every_steps` steps trained since
    the last one the sensor launched, while training goes on."""
    every = run_config.config.dagster.maintenance_every_steps
    if every is None:
        return dg.SkipReason("dagster.maintenance_every_steps is unset")
    if training_finished(run_config) is not None:
        return dg.SkipReason("training finished")
    runs = instance.get_runs(filters=dg.RunsFilter(job_name=delta_maintenance_job.name), limit=20)
    if runs and runs[0].status in BUSY:
        return dg.SkipReason(f"{delta_maintenance_job.name} run {runs[0].run_id} is going")
    last = next((int(r.tags[MAINTAINED_TAG]) for r in runs if MAINTAINED_TAG in r.tags), 0)
    step = newest_step(instance, TRAIN)
    if step - last < every:
        return dg.SkipReason(f"next Delta maintenance after step {last + every}")
    request = dg.RunRequest(
        run_key=f"{delta_maintenance_job.name}-{step_key(step)}",
        job_name=delta_maintenance_job.name,
        tags={MAINTAINED_TAG: str(step)},
    )
    return dg.SensorResult(run_requests=[request])


def evaluate_rft_loop(
    context: dg.SensorEvaluationContext, run_config: RunConfigResource
) -> dg.SensorResult | dg.SkipReason:
    """Every part's runs and runless events in one evaluation, or each part's skip reason.

    Dagster refuses a result that adds a partition twice, so the parts' partition requests
    become one per partitions definition.
    """
    parts = [
        trainer_request,
        checkpoint_records,
        weights_versions,
        evaluation_requests,
        lineage_check_request,
        maintenance_request,
    ]
    if run_config.config.dagster.builtin_explorer:
        # first: the daemon launches queued runs one by one (1.3-1.8 s each on 2 cores), and
        # the trainer's first step waits for the explorer's rows, not the other way round
        parts.insert(0, explorer_request)
    run_requests: list[dg.RunRequest] = []
    events: list[dg.AssetMaterialization | dg.AssetObservation | dg.AssetCheckEvaluation] = []
    keys: dict[str, dict[str, None]] = {}  # partitions to add, by definition, each once
    skipped: list[str] = []
    for part in parts:
        result = part(context.instance, run_config)
        if isinstance(result, dg.SkipReason):
            skipped.append(f"{part.__name__}: {result.skip_message}")
            continue
        run_requests += result.run_requests or []
        events += result.asset_events or []
        for request in result.dynamic_partitions_requests or []:
            added = keys.setdefault(request.partitions_def_name, {})
            added.update(dict.fromkeys(request.partition_keys or []))
    if not run_requests and not events and not keys:
        return dg.SkipReason("; ".join(skipped))
    return dg.SensorResult(
        run_requests=run_requests,
        asset_events=events,
        dynamic_partitions_requests=[
            dg.AddDynamicPartitionsRequest(name, list(added)) for name, added in keys.items()
        ],
    )
