"""End to end: a user steers a real training from `dagster dev`, over GraphQL as the UI does.

One `dagster dev` (webserver + daemon, from the repo root, on a temporary instance) runs a
training whose sensor keeps the long-lived trainer run going; the test writes each step's
experiences itself, so it knows where the loop stands when it acts. While the loop trains
(or waits for data) the test saves now, syncs now, evaluates a published version, pauses,
backfills two steps while paused, resumes and stops early with the final save, each as the
UI sends it; then it compares the final weights with those of the same steps trained without
any of that, and checks the lineage: `trained_exactly_once` run by the sensor at the end and
again on demand, each step's and checkpoint's upstream links. Screenshots of the lineage,
`train_step`'s plots, its per-step checks and a checkpoint's upstream are kept under
`test-artifacts/`.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from deltalake import DeltaTable
from safetensors.torch import load_file

from tests.support.dagster_dev import (
    CHROMIUM,
    FINISHED_BACKFILL,
    FINISHED_RUN,
    REPO_ROOT,
    REPOSITORY_SELECTOR,
    DagsterDev,
    GraphQLError,
    chromium,
    expect_type,
    processes_with_env,
)
from trinity_dagster.checkpoint.layout import HF_SUBDIR, checkpoint_dir, latest_weights_version
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.dagster_instance import instance_yaml
from trinity_dagster.handoff.trainer_state import STOPPED, read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import find_service, stop_service
from trinity_dagster.testing import fill_buffer, tiny_config
from trinity_dagster.trainer import Trainer

pytestmark = pytest.mark.slow

ARTIFACTS = REPO_ROOT / "test-artifacts" / "e2e_dagster_dev"
RUN_TIMEOUT_S = 300.0
TOTAL_STEPS = 8
STOP_AT = 6
ASSET_JOB = "__ASSET_JOB"
TRAINING_ASSETS = ("experience_batch", "train_step", "experiences", "checkpoint", "synced_weights")

LAUNCH_RUN = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message stack }
    ... on InvalidSubsetError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""
LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionSetNotFoundError { message }
    ... on InvalidSubsetError { message }
  }
}"""
RUN_STATUS = """
query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }"""
JOB_RUNS = """
query($job: String!) {
  runsOrError(filter: {pipelineName: $job}) {
    __typename ... on Runs { results { runId status } }
  }
}"""
BACKFILL_STATUS = """
query($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status runs(limit: 10) { runId status tags { key value } } }
  }
}"""
RUN_ERRORS = """
query($id: ID!) {
  logsForRun(runId: $id) {
    __typename
    ... on EventConnection {
      events {
        __typename
        ... on MessageEvent { message }
        ... on ExecutionStepFailureEvent { error { message causes { message } } }
        ... on RunFailureEvent { runError: error { message } }
      }
    }
  }
}"""
MATERIALIZATIONS = """
query($asset: [String!]!, $keys: [String!]) {
  assetOrError(assetKey: {path: $asset}) {
    __typename
    ... on Asset {
      assetMaterializations(partitions: $keys) {
        partition
        runId
        metadataEntries {
          label
          __typename
          ... on FloatMetadataEntry { floatValue }
          ... on IntMetadataEntry { intValue }
          ... on BoolMetadataEntry { boolValue }
        }
      }
    }
  }
}"""
CHECK_EXECUTIONS = """
query($check: String!) {
  assetCheckExecutions(assetKey: {path: ["train_step"]}, checkName: $check, limit: 100) {
    runId
    status
    evaluation { success metadataEntries { label ... on IntMetadataEntry { intValue } } }
  }
}"""
RUN_CHECK_EXECUTIONS = """
query($check: String!) {
  assetCheckExecutions(assetKey: {path: ["train_step"]}, checkName: $check, limit: 10) {
    runId
    status
    evaluation { success metadataEntries { label ... on IntMetadataEntry { intValue } } }
  }
}"""
LINKS = """
query($asset: [String!]!, $keys: [String!]) {
  assetOrError(assetKey: {path: $asset}) {
    ... on Asset {
      assetMaterializations(partitions: $keys) {
        tags { key value }
        metadataEntries {
          label
          ... on UrlMetadataEntry { url }
          ... on MarkdownMetadataEntry { mdStr }
          ... on TextMetadataEntry { text }
          ... on IntMetadataEntry { intValue }
        }
      }
    }
  }
}"""
WEIGHTS_VERSIONS = """
query {
  assetNodeOrError(assetKey: {path: ["evaluation"]}) {
    __typename ... on AssetNode { partitionKeys }
  }
}"""
PARTITION_KEYS = """
query {
  assetNodeOrError(assetKey: {path: ["train_step"]}) {
    __typename ... on AssetNode { partitionKeys }
  }
}"""


def run_failure(dev: DagsterDev, run_id: str) -> str:
    """The failure messages of a run, with their causes."""
    events = dev.graphql(RUN_ERRORS, {"id": run_id})["logsForRun"].get("events", [])
    lines = []
    for event in events:
        error = event.get("error") or event.get("runError")
        if error:
            lines.append(error["message"].strip())
            lines += [cause["message"].strip() for cause in error.get("causes", [])]
    return "\n".join(lines) or "(no error events)"


def run_status(dev: DagsterDev, run_id: str) -> str:
    return dev.graphql(RUN_STATUS, {"id": run_id})["runOrError"]["status"]


def wait_for_run(dev: DagsterDev, run_id: str, status: str = "SUCCESS") -> None:
    """Block until the run ends; fail with its errors unless it ended with `status`."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    found = "unknown"
    while time.monotonic() < deadline:
        found = run_status(dev, run_id)
        if found in FINISHED_RUN:
            break
        time.sleep(0.5)
    assert found == status, (
        f"run {run_id} ended {found}:\n{run_failure(dev, run_id)}\n{dev.log_tail(30)}"
    )


def wait_for(condition: Callable[[], Any], what: str, dev: DagsterDev) -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {RUN_TIMEOUT_S:.0f} s:\n{dev.log_tail()}")


def wait_for_backfill(dev: DagsterDev, backfill_id: str) -> list[dict[str, Any]]:
    """Block until the backfill completes successfully; returns its runs."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    backfill: dict[str, Any] = {}
    while time.monotonic() < deadline:
        backfill = dev.graphql(BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        expect_type(backfill, "PartitionBackfill", f"backfill {backfill_id}")
        if backfill["status"] in FINISHED_BACKFILL:
            break
        time.sleep(1)
    failures = [
        f"run {run['runId']} {run['status']}:\n{run_failure(dev, run['runId'])}"
        for run in backfill.get("runs", [])
        if run["status"] != "SUCCESS"
    ]
    assert backfill.get("status") in {"COMPLETED", "COMPLETED_SUCCESS"} and not failures, (
        f"backfill {backfill_id} ended {backfill.get('status')}:\n" + "\n".join(failures)
    )
    return backfill["runs"]


def materializations(dev: DagsterDev, asset: str, key: str | None = None) -> list[dict[str, Any]]:
    """Every materialisation of `asset` (of partition `key` if given): partition, run id and
    metadata values by label."""
    variables = {"asset": [asset], "keys": [key] if key else None}
    node = dev.graphql(MATERIALIZATIONS, variables)["assetOrError"]
    if node["__typename"] == "AssetNotFoundError":
        return []
    expect_type(node, "Asset", asset)
    out = []
    for event in node["assetMaterializations"]:
        values = {
            e["label"]: e.get("floatValue", e.get("intValue", e.get("boolValue")))
            for e in event["metadataEntries"]
        }
        out.append({"partition": event["partition"], "run": event["runId"], **values})
    return out


def recorded(dev: DagsterDev, asset: str) -> Counter[str]:
    """How many times each partition of `asset` was recorded."""
    return Counter(m["partition"] for m in materializations(dev, asset))


def weights_versions(dev: DagsterDev) -> list[str]:
    """The `weights_version` partitions the UI offers for `evaluation`."""
    node = dev.graphql(WEIGHTS_VERSIONS)["assetNodeOrError"]
    return expect_type(node, "AssetNode", "evaluation")["partitionKeys"]


def job_runs(dev: DagsterDev, job: str) -> list[dict[str, Any]]:
    runs = dev.graphql(JOB_RUNS, {"job": job})["runsOrError"]
    return expect_type(runs, "Runs", f"runs of {job}")["results"]


def launch(
    dev: DagsterDev, job: str, *, assets: tuple[str, ...] = (), partition: str | None = None
) -> str:
    """Launch a run as the UI's Launchpad / Materialize button does; returns its run id."""
    selector: dict[str, Any] = {**REPOSITORY_SELECTOR, "jobName": job}
    if assets:
        selector["assetSelection"] = [{"path": [asset]} for asset in assets]
    tags = [{"key": "dagster/partition", "value": partition}] if partition else []
    params = {"selector": selector, "executionMetadata": {"tags": tags}}
    launched = dev.graphql(LAUNCH_RUN, {"params": params})["launchRun"]
    what = f"launch {job} {assets} {partition}"
    return expect_type(launched, "LaunchRunSuccess", what)["run"]["runId"]


def visible_text(dom: str) -> str:
    """The text of a rendered DOM (scripts and styles dropped, whitespace collapsed)."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


class Steering:
    """The test's handle on the training: its config, paths, data and `dagster dev`."""

    def __init__(self, dev: DagsterDev, config: TrinityConfig) -> None:
        self.dev = dev
        self.config = config
        self.paths = RunPaths.of(config.run_root)
        self.data_steps = 0
        self.timings: list[str] = []

    def add_data(self, steps: int) -> None:
        """Write the experiences of `steps` more train steps, as an explorer would."""
        fill_buffer(self.config, steps, seed=100 + self.data_steps)
        self.data_steps += steps

    def trained(self) -> int:
        """The newest step a run recorded as trained."""
        return max((int(key) for key in recorded(self.dev, "train_step")), default=0)

    def wait_trained(self, step: int) -> None:
        wait_for(
            lambda: step_key(step) in recorded(self.dev, "train_step"), f"step {step}", self.dev
        )

    def act(self, what: str, run_id: str, status: str = "SUCCESS") -> None:
        """Wait for the run of a user's action and log how long it took, in steps and seconds."""
        started, at = time.monotonic(), self.trained()
        wait_for_run(self.dev, run_id, status)
        steps = self.trained() - at
        self.timings.append(f"{what}: {time.monotonic() - started:.1f} s, {steps} steps")
        print(self.timings[-1])
        assert steps <= 2, f"{what} took {steps} steps"


def step_key(step: int) -> str:
    return f"{step:06d}"


@pytest.fixture(scope="module")
def steering(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Steering]:
    """A `dagster dev` with the sensor on, over a training whose data the test writes."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure_programs.sh (CI does)")
    tmp_path = tmp_path_factory.mktemp("steer")
    extra = {
        "dagster": {"sensors_running": True, "builtin_explorer": False},
        # fill_buffer's logprobs are random, not the policy's: its ppo_kl exceeds the default
        "algorithm": {"kl_bound": 100.0},
        "trainer": {"total_steps": TOTAL_STEPS, "save_interval": 0, "save_hf_checkpoint": "last"},
        "synchronizer": {"sync_method": "checkpoint", "sync_interval": 100},
        "buffer": {"read_timeout_s": 1800},
    }
    config, config_file = tiny_config(tmp_path, extra)
    paths = RunPaths.of(config.run_root)
    paths.dagster_home.mkdir(parents=True, exist_ok=True)
    (paths.dagster_home / "dagster.yaml").write_text(instance_yaml(paths.dagster_home))
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    dev = DagsterDev(paths.dagster_home, config_file, ARTIFACTS / "dagster_dev.log")
    try:
        dev.start()
        dev.wait_until_up(timeout_s=180)
        yield Steering(dev, config)
    finally:
        dev.stop()
        stop_service(paths)
        engine_log = paths.logs / "engine.log"
        if engine_log.exists():
            shutil.copy(engine_log, ARTIFACTS / "engine.log")
    deadline = time.monotonic() + 30  # the engine exits shortly after it was stopped
    while (left := processes_with_env("DAGSTER_HOME", str(paths.dagster_home))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not left, f"processes of the dagster dev run left behind: {left}"


def test_steer_a_running_training_from_the_ui(steering: Steering) -> None:
    s, dev = steering, steering.dev
    s.add_data(2)
    s.wait_trained(2)  # the sensor's trainer run trained both steps and waits for step 3
    (trainer_run,) = job_runs(dev, "train_job")
    assert trainer_run["status"] == "STARTED"

    # save now: checkpoint[2] with its HF export, recorded in the user's run
    run = launch(dev, ASSET_JOB, assets=("checkpoint", "hf_model"), partition=step_key(2))
    s.act("save now", run)
    verify_checkpoint(checkpoint_dir(s.paths, 2))
    assert (checkpoint_dir(s.paths, 2) / HF_SUBDIR / "config.json").is_file()
    assert [m["run"] for m in materializations(dev, "checkpoint", step_key(2))] == [run]
    assert [m["run"] for m in materializations(dev, "hf_model", step_key(2))] == [run]

    # a step the engine is past fails at once, naming what can be saved
    run = launch(dev, ASSET_JOB, assets=("checkpoint",), partition=step_key(1))
    s.act("save a gone step", run, status="FAILURE")
    failure = run_failure(dev, run)
    assert "step 1 can no longer be saved: the engine is at step 2" in failure, failure
    assert "kept checkpoints: 2" in failure, failure

    # the save made weights version 2 (every checkpoint is one, as in Trinity-RFT); sync now
    # records it in the user's run (the sensor may have recorded the save's version too)
    run = launch(dev, ASSET_JOB, assets=("synced_weights",), partition=step_key(2))
    s.act("sync now", run)
    (synced,) = [m for m in materializations(dev, "synced_weights", step_key(2)) if m["run"] == run]
    assert synced["version"] == 2, synced
    assert latest_weights_version(s.paths) == 2  # step 2's export serves as weights 2

    # evaluate the published version beside training: the sensor offers its partition
    wait_for(lambda: step_key(2) in weights_versions(dev), "weights_version 000002 offered", dev)
    run = launch(dev, "evaluation_job", partition=step_key(2))
    s.act("evaluate", run)
    (evaluated,) = materializations(dev, "evaluation", step_key(2))
    assert 0.0 <= evaluated["eval/addition_eval/accuracy"] <= 1.0, evaluated
    assert job_runs(dev, "train_job")[0]["status"] == "STARTED", "training went on meanwhile"

    # pause after step 3: the trainer run ends, and the sensor starts none while paused
    s.add_data(1)
    s.wait_trained(3)
    run = launch(dev, "pause_training")
    s.act("pause", run)
    wait_for_run(dev, trainer_run["runId"])
    state = read_trainer_state(s.paths)
    assert state is not None and state.state == "paused" and state.step == 3, state

    # backfill steps 4 and 5 while paused, selecting train_step alone
    s.add_data(2)
    started = dev.graphql(
        LAUNCH_BACKFILL,
        {
            "params": {
                "partitionNames": [step_key(4), step_key(5)],
                "assetSelection": [{"path": ["train_step"]}],
            }
        },
    )["launchPartitionBackfill"]
    backfill_id = expect_type(started, "LaunchBackfillSuccess", "backfill 4..5")["backfillId"]
    (backfill_run,) = wait_for_backfill(dev, backfill_id)
    for asset in ("experience_batch", "train_step"):  # no hole in the lineage
        runs = {m["partition"]: m["run"] for m in materializations(dev, asset)}
        assert runs[step_key(4)] == runs[step_key(5)] == backfill_run["runId"], (asset, runs)
    state = read_trainer_state(s.paths)
    assert state is not None and state.state == "paused" and state.step == 5, state
    assert len(job_runs(dev, "train_job")) == 1, "the sensor must not restart a paused training"

    # resume: the sensor starts the trainer run from step 6
    run = launch(dev, "resume_training")
    s.act("resume", run)
    wait_for(lambda: len(job_runs(dev, "train_job")) == 2, "a new trainer run", dev)
    s.add_data(1)
    s.wait_trained(STOP_AT)

    # stop: the final blocking save with its HF export, as a normal end of training
    run = launch(dev, "stop_training")
    s.act("stop", run)
    state = read_trainer_state(s.paths)
    assert state is not None and state.state == "finished" and state.step == STOP_AT, state
    assert state.reason.startswith(STOPPED), state
    final = checkpoint_dir(s.paths, STOP_AT)
    verify_checkpoint(final)
    assert (final / HF_SUBDIR / "config.json").is_file()
    wait_for(lambda: step_key(STOP_AT) in recorded(dev, "checkpoint"), "the final checkpoint", dev)
    print("\n".join(s.timings))

    # every step recorded once; partitions are the trained steps only (100% filled)
    trained = [step_key(n) for n in range(1, STOP_AT + 1)]
    assert recorded(dev, "train_step") == Counter(trained)
    assert recorded(dev, "experience_batch") == Counter(trained)
    node = dev.graphql(PARTITION_KEYS)["assetNodeOrError"]
    assert node["partitionKeys"] == trained, node
    pinned = DeltaTable(s.paths.batches).to_pyarrow_table(columns=["step", "kind"]).to_pylist()
    per_step = Counter(row["step"] for row in pinned if row["kind"] == "train")
    assert per_step == {n: s.config.buffer.train_batch_size for n in range(1, STOP_AT + 1)}

    # each step's checks were logged as that step finished, by the run that trained it; the
    # checks are not partitioned, so their executions keep each run's newest evaluation,
    # which names the newest step that run trained (each step's own results are `check/...`
    # on its partition page, asserted below)
    train_runs = {m["partition"]: m["run"] for m in materializations(dev, "train_step")}
    newest_of_run: dict[str, str] = {}
    for key, run_id in train_runs.items():
        newest_of_run[run_id] = max(key, newest_of_run.get(run_id, key))
    for check in ("loss_is_finite", "kl_within_bound"):
        executions = dev.graphql(CHECK_EXECUTIONS, {"check": check})["assetCheckExecutions"]
        named = {
            e["runId"]: step_key(entry["intValue"])
            for e in executions
            if e["evaluation"] and e["evaluation"]["success"]
            for entry in e["evaluation"]["metadataEntries"]
            if entry["label"] == "step"
        }
        assert {run: named.get(run) for run in newest_of_run} == newest_of_run, (check, executions)

    assert_same_weights_as_uninterrupted(s)
    check_lineage(s)
    look_in_chromium(s)


def check_executions(dev: DagsterDev) -> list[dict[str, Any]]:
    """The executions of `trained_exactly_once`, newest first."""
    variables = {"check": "trained_exactly_once"}
    return dev.graphql(RUN_CHECK_EXECUTIONS, variables)["assetCheckExecutions"]


def links(dev: DagsterDev, asset: str, key: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The metadata values (urls, markdown, text, ints) and tags of a partition's newest
    materialisation."""
    node = dev.graphql(LINKS, {"asset": [asset], "keys": [key]})["assetOrError"]
    event = node["assetMaterializations"][0]
    values = {
        e["label"]: e.get("url", e.get("mdStr", e.get("text", e.get("intValue"))))
        for e in event["metadataEntries"]
    }
    return values, {t["key"]: t["value"] for t in event["tags"]}


def check_lineage(s: Steering) -> None:
    """The sensor ran `trained_exactly_once` at the end of training and it passed; a user
    runs it again on demand as the UI's "Execute" button does; each step and checkpoint names
    its upstream as links, and each batch carries its data version."""
    dev = s.dev
    wait_for(
        lambda: any(e["status"] == "SUCCEEDED" for e in check_executions(dev)),
        "the end-of-training trained_exactly_once check",
        dev,
    )
    (ran,) = job_runs(dev, "lineage_check_job")
    selector = {
        **REPOSITORY_SELECTOR,
        "jobName": ASSET_JOB,
        "assetSelection": [],
        "assetCheckSelection": [
            {"assetKey": {"path": ["train_step"]}, "name": "trained_exactly_once"}
        ],
    }
    launched = dev.graphql(LAUNCH_RUN, {"params": {"selector": selector}})["launchRun"]
    run = expect_type(launched, "LaunchRunSuccess", "execute the check")["run"]["runId"]
    wait_for_run(dev, run)
    newest, *_ = check_executions(dev)
    assert newest["runId"] == run and newest["evaluation"]["success"], newest
    counts = {e["label"]: e.get("intValue") for e in newest["evaluation"]["metadataEntries"]}
    batch = s.config.buffer.train_batch_size
    assert counts["experiences_trained"] == STOP_AT * batch, counts
    assert counts["steps_trained"] == STOP_AT, counts
    assert ran["runId"] != run

    values, tags = links(dev, "train_step", step_key(5))
    assert values["upstream/experience_batch"].endswith(
        "/assets/experience_batch?view=partitions&partition=000005"
    )
    assert values["upstream/parent_step"].endswith(
        "/assets/train_step?view=partitions&partition=000004"
    )
    assert "| weights version | experiences |" in values["upstream/weights_versions"], values
    _, batch_tags = links(dev, "experience_batch", step_key(5))
    assert tags["dagster/input_data_version/experience_batch"] == batch_tags["dagster/data_version"]
    values, _ = links(dev, "checkpoint", step_key(STOP_AT))
    assert values["upstream/train_step"].endswith(f"partition={step_key(STOP_AT)}"), values
    assert values["lineage/steps"] == f"1..{STOP_AT} from the initial model, no gap", values
    assert values["lineage/experiences_trained"] == STOP_AT * batch, values


def assert_same_weights_as_uninterrupted(s: Steering) -> None:
    """The final weights equal those of the same batches trained in one go, no actions."""
    root = s.paths.root.parent / "uninterrupted"
    shutil.copytree(s.paths.root / "experiences", root / "experiences")
    shutil.copytree(s.paths.root / "batches", root / "batches")  # the same pinned rows
    data = s.config.model_dump(mode="json")
    data["run_root"] = str(root)
    data["trainer"]["total_steps"] = STOP_AT
    file = root.parent / "uninterrupted.yaml"
    file.write_text(yaml.safe_dump(data))
    ref_paths = RunPaths.of(root)
    try:
        reason = asyncio.run(Trainer(load_config(file)).run())
        assert find_service(ref_paths) is None, "Trainer.run() stops the engine it started"
    finally:
        stop_service(ref_paths)
    assert reason.startswith(f"trained all {STOP_AT} steps"), reason
    ours = load_file(checkpoint_dir(s.paths, STOP_AT) / HF_SUBDIR / "model.safetensors")
    theirs = load_file(checkpoint_dir(ref_paths, STOP_AT) / HF_SUBDIR / "model.safetensors")
    assert ours.keys() == theirs.keys()
    delta = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert delta == 0.0, f"max |dw| = {delta} against the uninterrupted run"


def look_in_chromium(s: Steering) -> None:
    """The lineage, `train_step`'s plots and its per-step checks render in the UI."""
    dev = s.dev
    try:
        dev.graphql("mutation { setNuxSeen }")  # the first-visit dialog would hide the page
    except GraphQLError as err:
        pytest.fail(f"could not dismiss the first-visit dialog: {err}")
    group = f"{dev.url}/locations/trinity_dagster/asset-groups/training"
    lineage = visible_text(chromium(f"{group}/lineage"))
    missing = [name for name in TRAINING_ASSETS if name not in lineage]
    assert not missing, f"the lineage page lacks {missing}: {lineage[:2000]}"
    assert f"{STOP_AT} partitions" in lineage, lineage[:2000]
    chromium(f"{group}/lineage", screenshot=ARTIFACTS / "lineage.png")

    # selecting train_step opens its sidebar: latest metadata and per-partition plots
    selected = f"{group}/lineage/train_step"
    sidebar_dom = chromium(selected)
    assert "<canvas" in sidebar_dom, "the train_step sidebar draws no plot"
    sidebar = visible_text(sidebar_dom)
    for expected in ("Metadata plots", "actor/pg_loss", "parent_step"):
        assert expected in sidebar, f"the train_step sidebar lacks {expected!r}: {sidebar[:3000]}"
    chromium(selected, screenshot=ARTIFACTS / "train_step_plots.png")

    # a step's partition page shows that step's checks
    page = f"{dev.url}/assets/train_step?view=partitions&partition={step_key(3)}"
    text = visible_text(chromium(page))
    for expected in ("check/loss_is_finite passed", "check/kl_within_bound passed"):
        assert expected in text, f"the partition page lacks {expected!r}: {text[:4000]}"
    chromium(page, screenshot=ARTIFACTS / "train_step_partition_checks.png", height=2000)

    # a checkpoint's partition page shows its upstream: the step, the steps behind it, the
    # weights versions that produced their experiences
    page = f"{dev.url}/assets/checkpoint?view=partitions&partition={step_key(STOP_AT)}"
    text = visible_text(chromium(page))
    for expected in (
        "upstream/train_step",
        f"1..{STOP_AT} from the initial model, no gap",
        "weights version",
    ):
        assert expected in text, f"the checkpoint partition lacks {expected!r}: {text[:4000]}"
    chromium(page, screenshot=ARTIFACTS / "checkpoint_partition_upstream.png", height=2000)
    shots = (
        "lineage.png",
        "train_step_plots.png",
        "train_step_partition_checks.png",
        "checkpoint_partition_upstream.png",
    )
    for shot in shots:
        assert (ARTIFACTS / shot).stat().st_size > 20_000, f"{shot} looks blank"
    assert all(math.isfinite(m["actor/pg_loss"]) for m in materializations(dev, "train_step"))
