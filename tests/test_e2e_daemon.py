"""End to end through the real Dagster daemon: `dagster dev` with sensors on trains unattended.

The reference is the same configuration run by `trinity-dagster run` (which starts
`dagster-daemon` itself). Each test then drives a `dagster dev` on a fresh instance with the
settings `trinity-dagster` writes, and checks: every step trained exactly once, the final
checkpoint complete with its manifest and HF export, the pointer files, and final weights
bit-identical to the reference. Two of them kill things on the way: the trainer run's
worker and the engine's rank 0 mid-step (then `trinity-dagster lineage` must show every
experience trained exactly once and each checkpoint's ancestry whole), and the daemon (then
the whole `dagster dev`, restarted after).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml
from deltalake import DeltaTable

from tests.support.dagster_dev import REPO_ROOT, DagsterDev
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    latest_weights_version,
    scan_step_dirs,
)
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.config import load_config
from trinity_dagster.dagster_instance import write_instance_yaml
from trinity_dagster.explorer.eval_versions import versions_to_evaluate
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.service_api.records import read_record, recorded_steps
from trinity_dagster.service_api.state import pid_alive, read_state
from trinity_dagster.step_keys import step_key
from trinity_dagster.testing import TINY, merge
from trinity_dagster.torch_threads import engine_torch_threads

pytestmark = pytest.mark.slow

TOTAL_STEPS = 6
LOOP_TIMEOUT_S = 420.0
ORPHAN_TIMEOUT_S = 3.0
SETTINGS = {
    "trainer": {"total_steps": TOTAL_STEPS, "save_interval": 3, "sft_warmup_steps": 2},
    "explorer": {"tasks_per_step": 2, "eval_tasks": 8},
    "dagster": {"sensor_interval_s": 5},
}


def write_config(root: Path, tables_root: str | None = None, extra: dict | None = None) -> Path:
    """The test's configuration with its run root (and `buffer.tables_root`) under `root`,
    `extra` merged in."""
    root.mkdir(parents=True, exist_ok=True)
    file = root / "config.yaml"
    settings = merge(TINY, {**SETTINGS, "run_root": str(root / "run")})
    if tables_root is not None:
        settings = merge(settings, {"buffer": {"tables_root": tables_root}})
    settings = merge(settings, extra or {})
    file.write_text(yaml.safe_dump(settings))
    return file


def final_weights(paths: RunPaths) -> bytes:
    """The final checkpoint's exported weights, checked complete on the way."""
    assert latest_checkpoint_step(paths) == TOTAL_STEPS
    assert latest_weights_version(paths) == TOTAL_STEPS
    ckpt = checkpoint_dir(paths, TOTAL_STEPS)
    verify_checkpoint(ckpt, checksums=True)
    return (ckpt / "huggingface" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Final weights of the configuration trained by `trinity-dagster run`.

    Its Delta tables live outside the run root, under a file:// URI: every process of the
    loop (explorer, trainer, engine) must find them there, and the weights cannot depend on it.
    """
    base = tmp_path_factory.mktemp("reference")
    config_file = write_config(base, tables_root=(base / "tables").as_uri())
    command = [str(Path(sys.executable).parent / "trinity-dagster"), "run", "-c", str(config_file)]
    run = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout, stderr = run.communicate(timeout=LOOP_TIMEOUT_S)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    paths = RunPaths.of(load_config(config_file).run_root)
    # the command started the engine: it is the engine's owner
    assert f"owned by process {run.pid}:" in (paths.logs / "engine.log").read_text()
    summary = json.loads((paths.root / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["hf_model"], summary
    for table in ("experiences", "batches"):
        assert (base / "tables" / table / "_delta_log").is_dir(), table
        assert not (paths.root / table).exists(), table
    return final_weights(paths)


class Loop:
    """A `dagster dev` on a fresh instance of the test's configuration, sensors on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config_file = write_config(root)
        self.paths = RunPaths.of(load_config(self.config_file).run_root)
        write_instance_yaml(self.paths.dagster_home)
        self.devs: list[DagsterDev] = []

    def configure(self, extra: dict) -> None:
        """Merge `extra` into the configuration (before the first start)."""
        assert not self.devs, "configure the loop before starting it"
        self.config_file = write_config(self.root, extra=extra)

    def start(self) -> DagsterDev:
        log = self.paths.root / f"dagster_dev_{len(self.devs)}.log"
        dev = DagsterDev(self.paths.dagster_home, self.config_file, log)
        self.devs.append(dev)
        dev.start()
        dev.wait_until_up(timeout_s=180)
        return dev

    def stop(self) -> None:
        for dev in self.devs:
            dev.stop()
        stop_service(self.paths)

    def wait(self, what: str, ready, timeout_s: float = LOOP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                tail = self.devs[-1].log_tail(40) if self.devs else ""
                state = read_trainer_state(self.paths)
                raise AssertionError(f"timed out waiting for {what} (trainer: {state})\n{tail}")
            time.sleep(1)

    def finished(self) -> bool:
        state = read_trainer_state(self.paths)
        if state is not None and state.state == "failed":
            raise AssertionError(f"the trainer failed: {state.reason}")
        return state is not None and state.finished(TOTAL_STEPS)

    def instance(self) -> dg.DagsterInstance:
        return dg.DagsterInstance.from_config(str(self.paths.dagster_home))

    def check_exactly_once(self, retrained_up_to: int = 0) -> None:
        """One engine record and one `train_step` materialisation per step, except that an
        engine killed with no newer checkpoint trains steps 1..`retrained_up_to` again (a
        second materialisation of each, by the retried run)."""
        for step in range(1, TOTAL_STEPS + 1):
            record = read_record(self.paths, step)
            assert record is not None and record["step"] == step, step
        with self.instance() as instance:
            self.wait_for_checkpoint_record(instance)
            records = instance.fetch_materializations(dg.AssetKey("train_step"), limit=1000)
            counts = Counter(r.asset_materialization.partition for r in records.records)
        assert set(counts) == {step_key(s) for s in range(1, TOTAL_STEPS + 1)}, counts
        twice = {int(key) for key, n in counts.items() if n > 1}
        assert max(counts.values()) <= 2 and twice <= set(range(1, retrained_up_to + 1)), counts
        engine_log = (self.paths.logs / "engine.log").read_text()
        assert retrained_up_to or "replaying step" not in engine_log

    def check_lineage(self) -> None:
        """Through `trinity-dagster lineage --json`: every eid the explorer wrote was trained
        exactly once or waits above the sampler's cursor, and each kept checkpoint's ancestry
        goes back to step 0 without a gap."""
        written = DeltaTable(self.paths.experiences).to_pyarrow_table(columns=["eid"])
        eids = written.column("eid").to_pylist()
        answers = lineage(self.paths, "--eid", *eids)["eids"]
        assert [a["eid"] for a in answers] == eids
        statuses = Counter(a["status"] for a in answers)
        assert set(statuses) <= {"trained", "unconsumed"}, statuses
        for answer in answers:
            if answer["status"] == "trained":
                assert answer["uses"] == [{"step": answer["uses"][0]["step"], "kind": "train"}]
            else:
                assert answer["ingest_seq"] >= answer["cursor"], answer
        per_step = Counter(a["uses"][0]["step"] for a in answers if a["uses"])
        batch = load_config(self.config_file).buffer.train_batch_size
        assert per_step == {step: batch for step in range(1, TOTAL_STEPS + 1)}, per_step
        check = lineage(self.paths, "--check")
        assert check["passed"], check["problems"]
        assert check["experiences_trained"] == statuses["trained"] == TOTAL_STEPS * batch
        kept = [e.step for e in scan_step_dirs(self.paths.checkpoints) if e.kind == "final"]
        assert TOTAL_STEPS in kept, kept
        for step in kept:
            ancestry = lineage(self.paths, "--checkpoint", str(step))
            assert [(c["step"], c["parent"]) for c in ancestry["chain"]] == [
                (n, n - 1) for n in range(1, step + 1)
            ], ancestry["chain"]
            assert ancestry["missing_steps"] == ancestry["steps_without_record"] == []

    def wait_for_checkpoint_record(self, instance: dg.DagsterInstance) -> None:
        key = step_key(TOTAL_STEPS)
        self.wait(
            "rft_loop_sensor to record the final checkpoint",
            lambda: key in instance.get_materialized_partitions(dg.AssetKey("checkpoint")),
            timeout_s=60,
        )


@pytest.fixture
def loop(tmp_path: Path):
    made = Loop(tmp_path)
    try:
        yield made
    finally:
        made.stop()


def lineage(paths: RunPaths, *args: str) -> dict:
    """The JSON answer of `trinity-dagster lineage --run-root RUN ARGS --json`."""
    command = [str(Path(sys.executable).parent / "trinity-dagster"), "lineage"]
    command += ["--run-root", str(paths.root), *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def run_worker(paths: RunPaths, job: str) -> psutil.Process | None:
    """The worker process of the started `job` run, from the pid the run logged."""
    with dg.DagsterInstance.from_config(str(paths.dagster_home)) as instance:
        runs = instance.get_runs(
            filters=dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.STARTED]), limit=1
        )
        if not runs:
            return None
        records = instance.get_records_for_run(
            runs[0].run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
        ).records
    for record in records:
        message = record.event_log_entry.message or ""
        if "Started process for run (pid: " in message:
            pid = int(message.split("pid: ")[1].rstrip(")."))
            if psutil.pid_exists(pid):
                return psutil.Process(pid)
    return None


def test_daemon_trains_to_the_end_unattended(loop: Loop, reference: bytes) -> None:
    loop.configure({"service": {"orphan_timeout_s": ORPHAN_TIMEOUT_S}})
    dev = loop.start()
    loop.wait("the trainer to finish", loop.finished)
    loop.check_exactly_once()
    assert final_weights(loop.paths) == reference
    threads = engine_torch_threads(load_config(loop.config_file), len(os.sched_getaffinity(0)))
    assert f" {threads} torch thread(s)" in (loop.paths.logs / "engine.log").read_text()
    loop.wait("the run's scores", lambda: scoring_jobs(loop) is not None, timeout_s=120)
    # the explorer's run scored the initial, the SFT and the final weights and checked
    # lineage itself: no run worker started for them
    assert scoring_jobs(loop) == {
        "evaluation[000000]": "rollouts_job",
        "evaluation[000002]": "rollouts_job",
        f"evaluation[{step_key(TOTAL_STEPS)}]": "rollouts_job",
        "trained_exactly_once": "rollouts_job",
    }
    with loop.instance() as instance:
        jobs = {run.job_name for run in instance.get_runs()}
    assert jobs == {"train_job", "rollouts_job"}, jobs
    # the engine the trainer run started belongs to this dagster dev: stopped, it leaves the
    # engine idle for service.orphan_timeout_s, no longer for the whole idle timeout
    engine = read_state(loop.paths)
    assert engine is not None and dev.process is not None
    engine_log = loop.paths.logs / "engine.log"
    assert f"owned by process {dev.process.pid}:" in engine_log.read_text()
    dev.stop()
    loop.wait("the engine to stop", lambda: not pid_alive(engine.pid), timeout_s=120)
    assert f"its owner, process {dev.process.pid}, exited" in engine_log.read_text()


def scoring_jobs(loop: Loop) -> dict[str, str] | None:
    """The job of the run that recorded each end-of-training evaluation and the passed
    `trained_exactly_once` check, once all are recorded."""
    config = load_config(loop.config_file)
    versions = versions_to_evaluate(config, loop.paths, TOTAL_STEPS)
    found: dict[str, str] = {}
    with loop.instance() as instance:
        for version in versions:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey("evaluation"), asset_partitions=[step_key(version)]
                ),
                limit=1,
            ).records
            if not records:
                return None
            run = instance.get_run_by_id(records[0].run_id)
            found[f"evaluation[{step_key(version)}]"] = run.job_name if run else ""
        key = dg.AssetCheckKey(dg.AssetKey("train_step"), "trained_exactly_once")
        check = instance.event_log_storage.get_latest_asset_check_execution_by_key([key]).get(key)
        evaluation = (
            check.event.dagster_event.event_specific_data if check and check.event else None
        )
        if not isinstance(evaluation, dg.AssetCheckEvaluation) or not evaluation.passed:
            return None
        assert check is not None
        run = instance.get_run_by_id(check.run_id)
        found["trained_exactly_once"] = run.job_name if run else ""
    return found


def test_killed_trainer_worker_and_engine_are_restarted_and_finish(
    loop: Loop, reference: bytes
) -> None:
    loop.start()
    loop.wait("step 3 to start training", lambda: read_record(loop.paths, 2) is not None)
    loop.wait(
        "the trainer run's worker",
        lambda: run_worker(loop.paths, "train_job") is not None,
        timeout_s=60,
    )
    worker = run_worker(loop.paths, "train_job")
    engine = read_state(loop.paths)
    assert worker is not None and engine is not None
    os.kill(worker.pid, signal.SIGKILL)
    os.kill(engine.pid, signal.SIGKILL)  # rank 0: the engine restarts from its checkpoint
    trained = max(recorded_steps(loop.paths))
    loop.wait("the trainer to finish after the kills", loop.finished)
    loop.check_exactly_once(retrained_up_to=trained)
    assert final_weights(loop.paths) == reference
    loop.check_lineage()
    with loop.instance() as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(job_name="train_job"))
    assert len(runs) >= 2, "the killed trainer run was not retried"


def test_killed_daemon_then_restarted_dagster_dev_finishes(loop: Loop, reference: bytes) -> None:
    dev = loop.start()
    loop.wait("step 2 to be trained", lambda: read_record(loop.paths, 2) is not None)
    assert dev.process is not None
    daemons = [
        p
        for p in psutil.Process(dev.process.pid).children(recursive=True)
        if any(name in " ".join(p.cmdline()) for name in ("dagster-daemon", "dagster._daemon"))
    ]
    assert daemons, "no dagster-daemon process under dagster dev"
    for daemon in daemons:
        os.kill(daemon.pid, signal.SIGKILL)
    dev.stop()  # and with it the run workers of the dagster dev session
    loop.start()
    loop.wait("the trainer to finish after the restart", loop.finished)
    loop.check_exactly_once()
    assert final_weights(loop.paths) == reference


def test_nccl_sync_with_a_killed_engine_trains_to_the_reference_weights(
    tmp_path: Path, reference: bytes
) -> None:
    """`sync_method: NCCL` through `trinity-dagster run` (the real daemon, explorer and trainer
    in run workers of their own): every version reaches the explorer over the collective group,
    nothing is written per sync, and the final weights are bit-identical to the checkpoint-synced
    reference, although engine rank 0 (and the versions it held) is killed mid-run."""
    config_file = write_config(tmp_path, extra={"synchronizer": {"sync_method": "NCCL"}})
    paths = RunPaths.of(load_config(config_file).run_root)
    command = [str(Path(sys.executable).parent / "trinity-dagster"), "run", "-c", str(config_file)]
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + LOOP_TIMEOUT_S
        while read_record(paths, 4) is None:
            assert run.poll() is None and time.monotonic() < deadline, tmp_path / "run.log"
            time.sleep(0.2)
        engine = read_state(paths)
        assert engine is not None and engine.weight_sync_port is not None
        os.kill(engine.pid, signal.SIGKILL)
        assert run.wait(timeout=LOOP_TIMEOUT_S) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.wait(timeout=60)
        log.close()
        stop_service(paths)
    assert final_weights(paths) == reference
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0]  # no file per sync
    rows = DeltaTable(paths.experiences).to_pyarrow_table(columns=["model_version"])
    sft = SETTINGS["trainer"]["sft_warmup_steps"]
    assert set(range(sft, TOTAL_STEPS)) <= set(rows.column("model_version").to_pylist())
