"""The engine service: a real torchrun-launched service with a tiny Megatron model on CPU."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_checkpoint_step,
    latest_weights_version,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.checkpoint.manifest import read_manifest, verify_checkpoint
from trinity_dagster.faults import ENV as FAULT_ENV
from trinity_dagster.faults import Fault, fired_path, parse_fault
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import connect, live_service, stop_service
from trinity_dagster.service.server import check_bind_host
from trinity_dagster.service_api.client import EngineClient, EngineError
from trinity_dagster.service_api.state import (
    ServiceState,
    read_state,
    read_token,
    token_path,
    write_state,
)
from trinity_dagster.testing import fill_buffer, pin_steps, tiny_config


def final_weights(config) -> dict:
    paths = RunPaths.of(config.run_root)
    return load_file(weights_dir(paths, config.trainer.total_steps) / "model.safetensors")


@pytest.fixture
def service(tmp_path: Path):
    config, _ = tiny_config(tmp_path)
    fill_buffer(config, steps=config.trainer.total_steps)
    pin_steps(config, range(1, config.trainer.total_steps + 1))
    client = connect(config)
    yield config, client
    client.close()
    stop_service(RunPaths.of(config.run_root))


def test_service_trains_in_order_and_answers_status(service) -> None:
    config, client = service
    paths = RunPaths.of(config.run_root)
    status = client.status()
    assert status["step"] == 0 and status["health"] == "ok" and status["world_size"] == 1
    assert stat.S_IMODE(token_path(paths).stat().st_mode) == 0o600

    first = client.train_step(1, pin_version=1)  # the rows from the file pin commit 1 added
    assert first["step"] == 1 and not first["already_trained"] and first["batch_size"] > 0
    assert set(first["metrics"]) >= {"actor/pg_loss", "actor/grad_norm", "perf/throughput"}
    again = client.train_step(1)
    assert again["already_trained"] and again["metrics"] == first["metrics"]

    with pytest.raises(EngineError) as ahead:
        client.train_step(3)
    assert ahead.value.status == 409
    assert "step 3" in str(ahead.value) and "2..2" in str(ahead.value)
    assert client.status()["step"] == 1

    # sync_interval 1: step 1's weights were published as version 1
    synced = client.publish_weights(1)
    assert synced["version"] == 1 and Path(synced["path"], "model.safetensors").is_file()
    client.train_step(2)  # save_interval 2: a full checkpoint of step 2 (in the background)
    saved = client.save_checkpoint(2, block=True)
    assert not saved["pending"] and saved["files"] > 0 and len(saved["manifest_sha256"]) == 64
    assert latest_checkpoint_step(paths) == 2

    with pytest.raises(EngineError) as late:
        client.save_checkpoint(1)
    assert late.value.status == 409 and "engine is at step 2" in str(late.value)

    # superseded sync-only versions are pruned beside the next commands (keep_synced_weights 2)
    client.train_step(3)
    client.publish_weights(3)
    assert "published" not in client.train_step(4)
    published = client.train_step(5, publish=True)["published"]  # trained, then published
    assert published["version"] == 5 and published["publish_s"] > 0
    assert Path(published["path"], "model.safetensors").is_file()
    assert latest_weights_version(paths) == 5
    assert client.train_step(5, publish=True)["published"]["version"] == 5  # a retried call
    deadline = time.monotonic() + 30
    while (finals := _final_weights(paths)) != [0, 3, 5] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert finals == [0, 3, 5]


def _final_weights(paths: RunPaths) -> list[int]:
    return [d.step for d in scan_step_dirs(paths.weights) if d.kind == "final"]


def test_token_is_required_and_wrong_tokens_change_nothing(service) -> None:
    _, client = service
    url = client.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "token"}):
        for method, path in (("GET", "/status"), ("POST", "/train_step")):
            response = httpx.request(method, url + path, headers=headers, json={"step": 1})
            assert response.status_code == 401, (method, path, headers)
    assert client.status()["step"] == 0
    with pytest.raises(EngineError) as bad_json:
        client._call("POST", "/train_step", {"step": 1, "pickle": "x"})
    assert bad_json.value.status == 422
    with pytest.raises(EngineError) as bad_version:
        client.train_step(1, pin_version=-1)
    assert bad_version.value.status == 422 and "pin_version" in str(bad_version.value)


def test_non_loopback_bind_needs_the_flag() -> None:
    check_bind_host("127.0.0.1", allow_non_loopback=False)
    check_bind_host("::1", allow_non_loopback=False)
    for host in ("0.0.0.0", "192.0.2.1", "example.org"):
        with pytest.raises(PermissionError, match="allow_non_loopback"):
            check_bind_host(host, allow_non_loopback=False)
    check_bind_host("0.0.0.0", allow_non_loopback=True)


def test_stale_state_file_is_detected_and_replaced(tmp_path: Path) -> None:
    config, _ = tiny_config(tmp_path)
    paths = RunPaths.of(config.run_root)
    paths.service.mkdir(parents=True)
    dead = ServiceState(
        pid=2**22 + 12345,
        pgid=2**22 + 12345,
        launcher_pid=2**22 + 12346,
        host="127.0.0.1",
        port=1,
        world_size=1,
        config_hash="x",
        log_file="",
    )
    write_state(paths, dead)
    assert live_service(paths) is None
    assert read_state(paths) is None


def _assert_marker_names_a_verified_checkpoint(paths: RunPaths) -> None:
    marker = latest_checkpoint_step(paths)
    if marker is not None:
        verify_checkpoint(checkpoint_dir(paths, marker))


def _train_and_save(client, config, step: int) -> dict:
    """Train step N, then save as the trainer loop would (background; the final one blocks
    and serves as the sync)."""
    result = client.train_step(step)
    final = step == config.trainer.total_steps
    if final or step % config.trainer.save_interval == 0:
        client.save_checkpoint(step, block=final, hf=final, serves_as_sync=final)
    return result


def _train_all_with_kills(config, kills: int, seed: int) -> list[list[int]]:
    """Drive every step through the client, kill -9 the service at random moments."""
    rng = random.Random(seed)
    paths = RunPaths.of(config.run_root)
    replays = []
    step = 1
    kills_left = kills
    while step <= config.trainer.total_steps:
        with connect(config) as client:
            state = read_state(paths)
            if kills_left and rng.random() < 0.6:
                killer = threading.Timer(rng.uniform(0.0, 1.5), os.killpg, (state.pgid, 9))
                killer.start()
                kills_left -= 1
                try:
                    result = _train_and_save(client, config, step)
                except (EngineError, OSError, httpx.HTTPError):
                    continue
                finally:
                    killer.join()
                    _assert_marker_names_a_verified_checkpoint(paths)
            else:
                result = _train_and_save(client, config, step)
            replays.append(result["replayed"])
            step += 1
    return replays


@pytest.mark.slow
def test_kill_9_at_random_points_reaches_the_uninterrupted_weights(tmp_path: Path) -> None:
    reference, _ = tiny_config(tmp_path / "reference")
    fill_buffer(reference, steps=reference.trainer.total_steps)
    pin_steps(reference, range(1, reference.trainer.total_steps + 1))
    with connect(reference) as client:
        for step in range(1, reference.trainer.total_steps + 1):
            _train_and_save(client, reference, step)
    stop_service(RunPaths.of(reference.run_root))
    expected = final_weights(reference)

    crashed, _ = tiny_config(tmp_path / "crashed")
    fill_buffer(crashed, steps=crashed.trainer.total_steps)
    pin_steps(crashed, range(1, crashed.trainer.total_steps + 1))
    try:
        replays = _train_all_with_kills(crashed, kills=10, seed=7)
    finally:
        stop_service(RunPaths.of(crashed.run_root))
    got = final_weights(crashed)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].equal(tensor), name
    assert len(replays) == crashed.trainer.total_steps


@pytest.mark.slow
def test_two_rank_service_trains(tmp_path: Path) -> None:
    config, _ = tiny_config(tmp_path, {"megatron": {"data_parallel_size": 2}})
    fill_buffer(config, steps=2)
    pin_steps(config, range(1, 3))
    paths = RunPaths.of(config.run_root)
    try:
        with connect(config) as client:
            assert client.status()["world_size"] == 2
            result = client.train_step(1)
            assert result["metrics"]["actor/grad_norm"] > 0
            assert client.train_step(2)["step"] == 2
    finally:
        stop_service(paths)
    assert read_state(paths) is None


def test_client_reports_unreachable_service(tmp_path: Path) -> None:
    config, _ = tiny_config(tmp_path)
    paths = RunPaths.of(config.run_root)
    paths.service.mkdir(parents=True)
    with pytest.raises(ConnectionError, match="no engine service"):
        connect(config, autostart=False)
    token_path(paths).write_text("t")
    token_path(paths).chmod(0o644)
    with pytest.raises(PermissionError, match="0600"):
        read_token(paths)
    with EngineClient("http://127.0.0.1:9", "t") as client, pytest.raises(ConnectionError):
        client.status()


def test_convert_turns_a_checkpoint_into_the_same_hf_weights(service, tmp_path: Path) -> None:
    config, client = service
    client.train_step(1)
    client.train_step(2)
    client.save_checkpoint(2, block=True, hf=True)
    ckpt = RunPaths.of(config.run_root).checkpoints / "global_step_2"
    out = tmp_path / "converted"
    cli = [sys.executable, "-m", "trinity_dagster.cli", "convert"]
    done = subprocess.run(
        [*cli, "--checkpoint", str(ckpt), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = load_file(ckpt / "huggingface" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert got.keys() == expected.keys()
    assert all(got[name].equal(tensor) for name, tensor in expected.items())
    assert (out / "tokenizer_config.json").is_file()

    victim = next(p for p in (ckpt / "dist").rglob("*") if p.is_file() and p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1])
    broken = subprocess.run(
        [*cli, "--checkpoint", str(ckpt), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert broken.returncode == 2
    assert victim.name in broken.stderr


def test_synced_weights_and_the_checkpoint_export_are_the_same_hf_directory(service) -> None:
    """Explorers get the same files, config and tensors by a sync as from a checkpoint."""
    config, client = service
    client.train_step(1)
    synced = Path(client.publish_weights(1)["path"])
    client.save_checkpoint(1, block=True, hf=True)
    exported = checkpoint_dir(RunPaths.of(config.run_root), 1) / "huggingface"
    names = sorted(p.name for p in synced.iterdir())
    assert names == sorted(p.name for p in exported.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(names)
    for name in names:
        if name != "model.safetensors":
            assert (synced / name).read_bytes() == (exported / name).read_bytes(), name
    got, expected = (
        load_file(synced / "model.safetensors"),
        load_file(exported / "model.safetensors"),
    )
    assert got.keys() == expected.keys()
    assert all(got[name].equal(tensor) for name, tensor in expected.items())


def test_next_step_trains_while_the_previous_save_is_written(service) -> None:
    """Only the final save blocks: step N+1 starts before checkpoint N is complete."""
    config, client = service
    paths = RunPaths.of(config.run_root)
    client.train_step(1)
    client.train_step(2)
    pending = client.save_checkpoint(2, block=False)
    assert pending["pending"], pending
    third = client.train_step(3)
    done = client.save_checkpoint(2, block=True)
    assert not done["pending"]
    manifest = read_manifest(paths.checkpoints / "global_step_2")
    completed = datetime.fromisoformat(manifest.created_at).timestamp()
    assert third["started_at"] < completed, (third["started_at"], manifest.created_at)


def test_a_fault_spec_names_a_window_an_optional_step_and_mode() -> None:
    assert parse_fault("") is None
    assert parse_fault("weights_renamed") == Fault("weights_renamed", None, "kill")
    assert parse_fault("train_forward:3:hang") == Fault("train_forward", 3, "hang")
    assert parse_fault("shm_upload:hang") == Fault("shm_upload", None, "hang")
    assert Fault("optimizer_step", 2, "kill").matches("optimizer_step", 2)
    assert not Fault("optimizer_step", 2, "kill").matches("optimizer_step", 3)
    for bad in ("nowhere:1", "train_forward:x", "train_forward:1:2"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}={bad!r}"):
            parse_fault(bad)


ARMED_FAULT = """
import sys
from trinity_dagster.paths import RunPaths
from trinity_dagster import faults
print(faults.arm(RunPaths.of(sys.argv[1]), rank=int(sys.argv[2])), flush=True)
faults.fault_point("weights_publish", 2)
faults.fault_point("weights_publish", 3)
print("alive", flush=True)
"""


def test_an_armed_fault_kills_rank_0_once_per_run_root(tmp_path: Path) -> None:
    env = {**os.environ, FAULT_ENV: "weights_publish:3"}

    def run(rank: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", ARMED_FAULT, str(tmp_path), str(rank)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    other_rank = run(1)
    assert other_rank.returncode == 0 and other_rank.stdout.split() == ["None", "alive"]
    killed = run(0)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "alive" not in killed.stdout
    fired = json.loads(fired_path(RunPaths.of(tmp_path)).read_text())
    assert (fired["window"], fired["step"], fired["mode"]) == ("weights_publish", 3, "kill")
    restarted = run(0)  # the fault fired for this run root: not armed again
    assert restarted.returncode == 0 and restarted.stdout.split() == ["None", "alive"]
