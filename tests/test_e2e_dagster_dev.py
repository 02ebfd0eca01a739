"""End to end: a real `dagster dev` trains two steps, driven over GraphQL and seen in Chromium.

The webserver and daemon run from the repo root on a temporary instance; the runs start the
real engine service (torchrun, Megatron-core on CPU). Screenshots of the training lineage and
of `train_step`'s metadata plots are kept under `test-artifacts/`.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from tests.dagster_dev_helpers import (
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
from tests.run_helpers import fill_buffer, tiny_config
from trinity_dagster.dagster_instance import instance_yaml
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service

pytestmark = pytest.mark.slow

ARTIFACTS = REPO_ROOT / "test-artifacts" / "e2e_dagster_dev"
RUN_TIMEOUT_S = 300.0
TRAINING_ASSETS = ("experience_batch", "train_step", "experiences", "checkpoint", "synced_weights")

ADD_PARTITION = """
mutation($repo: RepositorySelector!, $key: String!) {
  addDynamicPartition(repositorySelector: $repo, partitionsDefName: "step", partitionKey: $key) {
    __typename
    ... on AddDynamicPartitionSuccess { partitionKey }
    ... on PythonError { message }
    ... on UnauthorizedError { message }
    ... on DuplicateDynamicPartitionError { partitionName }
  }
}"""
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
query($keys: [String!]) {
  assetOrError(assetKey: {path: ["train_step"]}) {
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
        }
      }
    }
  }
}"""


@pytest.fixture
def dagster_dev(tmp_path: Path) -> Iterator[tuple[DagsterDev, RunPaths]]:
    """A `dagster dev` on a fresh instance whose run has experiences for two steps."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure_chromium.sh (CI does)")
    # fill_buffer's logprobs are random, not the policy's: its ppo_kl exceeds the default bound
    extra = {"dagster": {"sensors_running": False}, "algorithm": {"kl_bound": 100.0}}
    config, config_file = tiny_config(tmp_path, extra)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, steps=2)
    paths.dagster_home.mkdir(parents=True, exist_ok=True)
    (paths.dagster_home / "dagster.yaml").write_text(instance_yaml(paths.dagster_home))
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    dev = DagsterDev(paths.dagster_home, config_file, ARTIFACTS / "dagster_dev.log")
    try:
        dev.start()
        dev.wait_until_up(timeout_s=180)
        yield dev, paths
    finally:
        dev.stop()
        stop_service(paths)
        engine_log = paths.logs / "engine.log"
        if engine_log.exists():
            shutil.copy(engine_log, ARTIFACTS / "engine.log")
    deadline = time.monotonic() + 30  # torchrun exits shortly after its stopped worker
    while (left := processes_with_env("DAGSTER_HOME", str(paths.dagster_home))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not left, f"processes of the dagster dev run left behind: {left}"


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


def wait_for_run(dev: DagsterDev, run_id: str) -> None:
    """Block until the run succeeds; fail with its errors if it does not."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    status = "unknown"
    while time.monotonic() < deadline:
        status = dev.graphql(RUN_STATUS, {"id": run_id})["runOrError"]["status"]
        if status in FINISHED_RUN:
            break
        time.sleep(2)
    assert status == "SUCCESS", (
        f"run {run_id} ended {status}:\n{run_failure(dev, run_id)}\n{dev.log_tail(30)}"
    )


def wait_for_backfill(dev: DagsterDev, backfill_id: str) -> list[dict[str, Any]]:
    """Block until the backfill completes successfully; returns its runs."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    backfill: dict[str, Any] = {}
    while time.monotonic() < deadline:
        backfill = dev.graphql(BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        expect_type(backfill, "PartitionBackfill", f"backfill {backfill_id}")
        if backfill["status"] in FINISHED_BACKFILL:
            break
        time.sleep(2)
    failures = [
        f"run {run['runId']} {run['status']}:\n{run_failure(dev, run['runId'])}"
        for run in backfill.get("runs", [])
        if run["status"] != "SUCCESS"
    ]
    assert backfill.get("status") in {"COMPLETED", "COMPLETED_SUCCESS"} and not failures, (
        f"backfill {backfill_id} ended {backfill.get('status')}:\n" + "\n".join(failures)
    )
    return backfill["runs"]


def step_metadata(dev: DagsterDev, key: str) -> list[dict[str, Any]]:
    """The metadata of every `train_step` materialisation of partition `key`, as dicts."""
    asset = dev.graphql(MATERIALIZATIONS, {"keys": [key]})["assetOrError"]
    expect_type(asset, "Asset", "train_step")
    out = []
    for event in asset["assetMaterializations"]:
        assert event["partition"] == key
        entries = {}
        for entry in event["metadataEntries"]:
            value = entry.get("floatValue", entry.get("intValue"))
            entries[entry["label"]] = value
        out.append(entries)
    return out


def visible_text(dom: str) -> str:
    """The text of a rendered DOM (scripts and styles dropped, whitespace collapsed)."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def test_dagster_dev_trains_two_steps_and_shows_lineage_and_plots(dagster_dev) -> None:
    dev, paths = dagster_dev
    for key in ("000001", "000002"):
        added = dev.graphql(ADD_PARTITION, {"repo": REPOSITORY_SELECTOR, "key": key})
        expect_type(added["addDynamicPartition"], "AddDynamicPartitionSuccess", f"add {key}")

    launched = dev.graphql(
        LAUNCH_RUN,
        {
            "params": {
                "selector": {**REPOSITORY_SELECTOR, "jobName": "train_job"},
                "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "000001"}]},
            }
        },
    )["launchRun"]
    run_id = expect_type(launched, "LaunchRunSuccess", "launch train_job[000001]")["run"]["runId"]
    wait_for_run(dev, run_id)

    (first,) = step_metadata(dev, "000001")
    assert math.isfinite(first["actor/pg_loss"]), first
    assert first["parent_step"] == 0 and first["weights_version"] == 1, first

    # step 2 as an asset backfill; the single-run policy gives it one run
    started = dev.graphql(
        LAUNCH_BACKFILL,
        {
            "params": {
                "partitionNames": ["000002"],
                "assetSelection": [{"path": ["experience_batch"]}, {"path": ["train_step"]}],
            }
        },
    )["launchPartitionBackfill"]
    backfill_id = expect_type(started, "LaunchBackfillSuccess", "backfill 000002")["backfillId"]
    (backfill_run,) = wait_for_backfill(dev, backfill_id)
    tags = {tag["key"]: tag["value"] for tag in backfill_run["tags"]}
    assert tags.get("dagster/backfill") == backfill_id, tags
    (second,) = step_metadata(dev, "000002")
    assert math.isfinite(second["actor/pg_loss"]) and second["parent_step"] == 1, second
    # the engine trained on what the runs pinned in Delta: batch sizes agree with the table
    pinned = DeltaTable(paths.batches).to_pyarrow_table(columns=["step", "kind"]).to_pylist()
    per_step = Counter(row["step"] for row in pinned if row["kind"] == "train")
    assert per_step == {1: first["batch_size"], 2: second["batch_size"]}, per_step
    assert first["batch_size"] > 0, first

    try:
        dev.graphql("mutation { setNuxSeen }")  # the first-visit dialog would hide the page
    except GraphQLError as err:
        pytest.fail(f"could not dismiss the first-visit dialog: {err}")
    group = f"{dev.url}/locations/trinity_dagster/asset-groups/training"
    lineage = visible_text(chromium(f"{group}/lineage"))
    missing = [name for name in TRAINING_ASSETS if name not in lineage]
    assert not missing, f"the lineage page lacks {missing}: {lineage[:2000]}"
    for expected in ("2 partitions", "2 / 2 Passed"):  # both steps trained, both checks passed
        assert expected in lineage, f"the lineage page lacks {expected!r}: {lineage[:2000]}"
    chromium(f"{group}/lineage", screenshot=ARTIFACTS / "lineage.png")

    # selecting train_step opens its sidebar: latest metadata and per-partition plots
    selected = f"{group}/lineage/train_step"
    sidebar_dom = chromium(selected)
    assert "<canvas" in sidebar_dom, "the train_step sidebar draws no plot"
    sidebar = visible_text(sidebar_dom)
    for expected in ("Metadata plots", "actor/pg_loss", "parent_step"):
        assert expected in sidebar, f"the train_step sidebar lacks {expected!r}: {sidebar[:3000]}"
    chromium(selected, screenshot=ARTIFACTS / "train_step_plots.png")
    for shot in ("lineage.png", "train_step_plots.png"):
        assert (ARTIFACTS / shot).stat().st_size > 20_000, f"{shot} looks blank"
