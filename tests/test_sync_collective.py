"""`synchronizer.sync_method: nccl`: weights from engine rank 0 to explorers over a collective
group of their own (gloo here), checked bucket by bucket, with nothing written per sync."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.explored_run import train_beside_explorer
from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.checkpoint.layout import (
    checkpoint_dir,
    latest_weights_version,
    scan_step_dirs,
    weights_dir,
)
from trinity_dagster.config import TrinityConfig
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.client import EngineClient
from trinity_dagster.service_api.state import ServiceState, read_state, read_token, write_state
from trinity_dagster.testing import free_port, tiny_config
from trinity_dagster.weight_sync import announce, receiver
from trinity_dagster.weight_sync.buckets import pack
from trinity_dagster.weight_sync.receiver import WeightSyncError, receive_described
from trinity_dagster.weight_sync.sender import VersionNotHeldError, WeightSender

NCCL = {"synchronizer": {"sync_method": "NCCL"}, "explorer": {"tasks_per_step": 2}}


@pytest.fixture
def sender() -> Iterator[WeightSender]:
    made = WeightSender("127.0.0.1", "127.0.0.1", timeout_s=20)
    yield made
    made.close()


def mixed_tensors() -> dict[str, torch.Tensor]:
    """A large tensor (sent alone), small ones (packed), one of an odd byte length."""
    generator = torch.Generator().manual_seed(3)
    return {
        "big.weight": torch.randn(1024, 4096, generator=generator),
        "small.bias": torch.randn(7, generator=generator),
        "half.weight": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "odd": torch.randn(2_100_001, generator=generator),
    }


def wait_for_transfers(sender: WeightSender, count: int) -> list[dict]:
    deadline = time.monotonic() + 30
    while len(sender.transfers) < count:
        assert time.monotonic() < deadline, list(sender.transfers)
        time.sleep(0.01)
    return list(sender.transfers)


def test_config_reads_trinitys_method_name_in_any_case(tmp_path: Path) -> None:
    config, _ = tiny_config(tmp_path, NCCL)
    assert config.synchronizer.sync_method == "nccl"


def test_buckets_pack_small_tensors_and_send_large_ones_alone() -> None:
    tensors = mixed_tensors()
    layout, buffers = pack(tensors, bucket_bytes=1 << 20, alone_bytes=1 << 20)
    slots = {slot.name: slot for slot in layout.tensors}
    assert slots["small.bias"].bucket == slots["half.weight"].bucket  # packed together
    assert slots["big.weight"].bucket != slots["odd"].bucket
    big = buffers[slots["big.weight"].bucket]
    assert big.data_ptr() == tensors["big.weight"].data_ptr()  # sent from its own memory
    assert all(b.numel() % 8 == 0 for b in buffers)
    assert layout.nbytes == sum(b.numel() for b in buffers)


def test_a_transfer_delivers_every_tensor_bit_for_bit(sender: WeightSender) -> None:
    tensors = mixed_tensors()
    targets = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in tensors.items()}
    sender.stage(4, tensors)
    got = receive_described(sender.open_transfer(4, "explorer-a"), targets)
    for name, tensor in tensors.items():
        assert torch.equal(targets[name], tensor.float()), name
    assert got.version == 4 and got.nbytes == sender.layout_bytes(4)
    assert got.direct_buckets == 1  # big.weight went straight into its target
    [record] = wait_for_transfers(sender, 1)
    assert record["ok"] and record["receiver"] == "explorer-a" and record["version"] == 4


def test_a_damaged_bucket_is_caught_by_the_receiver_and_reported_to_the_sender(
    sender: WeightSender,
) -> None:
    tensors = mixed_tensors()
    targets = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in tensors.items()}
    sender.stage(1, tensors)
    sender.corrupt_next_transfer(bucket=0)
    with pytest.raises(WeightSyncError, match=r"bucket 0 of weights version 1 .*damaged"):
        receive_described(sender.open_transfer(1, "explorer-a"), targets)
    [record] = wait_for_transfers(sender, 1)
    assert not record["ok"] and "damaged" in record["error"]
    # the held copy was not touched: the next transfer is whole
    receive_described(sender.open_transfer(1, "explorer-a"), targets)
    assert torch.equal(targets["big.weight"], tensors["big.weight"])


def test_a_receiver_that_never_joins_or_gives_up_fails_only_its_own_transfer() -> None:
    sender = WeightSender("127.0.0.1", "127.0.0.1", timeout_s=2)
    try:
        tensors = mixed_tensors()
        sender.stage(1, tensors)
        sender.open_transfer(1, "never-joins")
        sender.stage(2, tensors)  # the loop goes on meanwhile
        other_model = {**tensors, "big.weight": torch.zeros(3)}  # refused before any bucket
        with pytest.raises(WeightSyncError, match="other shapes"):
            receive_described(sender.open_transfer(2, "gives-up"), other_model)
        targets = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in tensors.items()}
        receive_described(sender.open_transfer(2, "rejoins"), targets)
        records = {r["receiver"]: r for r in wait_for_transfers(sender, 3)}
        assert records["rejoins"]["ok"]
        assert not records["never-joins"]["ok"] and records["never-joins"]["seconds"] < 10
        assert not records["gives-up"]["ok"] and "other shapes" in records["gives-up"]["error"]
    finally:
        sender.close()


def test_an_unheld_version_is_refused_naming_the_held_ones(sender: WeightSender) -> None:
    for version in (1, 2, 3):
        sender.stage(version, {"w": torch.full((4,), float(version))})
    assert sender.versions() == [2, 3]  # the newest two
    with pytest.raises(VersionNotHeldError, match=r"version 1 is not held .*held: 2, 3"):
        sender.open_transfer(1, "late")


@pytest.fixture
def nccl_run(tmp_path: Path) -> tuple[TrinityConfig, RunPaths]:
    config, _ = tiny_config(tmp_path / "nccl", NCCL)
    return config, RunPaths.of(config.run_root)


def as_running_service(paths: RunPaths, sender: WeightSender, monkeypatch) -> None:
    """Make this process look like the run's engine rank 0 holding `sender`'s versions."""
    state = ServiceState(
        pid=os.getpid(),
        pgid=os.getpgid(0),
        launcher_pid=os.getppid(),
        host="127.0.0.1",
        port=1,
        world_size=1,
        config_hash="test",
        log_file="",
        weight_sync_port=sender.port,
    )
    write_state(paths, state)
    served = lambda _paths, version, who: sender.open_transfer(version, who)  # noqa: E731
    monkeypatch.setattr(receiver, "request_transfer", served)


def test_the_explorer_receives_a_version_in_place_and_drops_a_damaged_one(
    nccl_run: tuple[TrinityConfig, RunPaths], sender: WeightSender, monkeypatch
) -> None:
    config, paths = nccl_run
    source = create_initial_model(config, paths)
    initial = load_file(source / "model.safetensors")
    trained = {name: t + 0.5 for name, t in initial.items()}
    as_running_service(paths, sender, monkeypatch)
    explorer = Explorer(config, paths)
    model = explorer.policy(0)

    sender.stage(1, trained)
    announce.announce(paths, 1)
    assert announce.announced_version(paths) == 1
    assert explorer.policy(1) is model  # received in place, not loaded from disk
    for name, tensor in trained.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0]  # nothing on disk

    sender.stage(2, {name: t + 1.0 for name, t in initial.items()})
    announce.announce(paths, 2)
    sender.corrupt_next_transfer(bucket=0)
    with pytest.raises(WeightSyncError, match="damaged"):
        explorer.policy(2)
    assert explorer.loaded_version is None  # the half-updated model is gone
    fresh = explorer.policy(2)
    assert fresh is not model
    for name, tensor in initial.items():
        assert torch.equal(fresh.state_dict()[name], tensor + 1.0), name

    announce.withdraw(paths)
    assert announce.announced_version(paths) is None


def test_an_announcement_of_a_dead_service_counts_for_nothing(
    nccl_run: tuple[TrinityConfig, RunPaths], sender: WeightSender, monkeypatch
) -> None:
    _, paths = nccl_run
    as_running_service(paths, sender, monkeypatch)
    announce.announce(paths, 5)
    state = read_state(paths)
    assert state is not None
    write_state(paths, ServiceState(**{**state.__dict__, "pid": state.pid + 1}))  # a new service
    assert announce.announced_version(paths) is None


def test_a_transfer_from_a_service_that_died_after_answering_fails_in_seconds() -> None:
    """The engine answered the request, then died before the receiver joined its store: the
    receiver gives up in seconds, not after the transfer's timeout."""
    tensors = mixed_tensors()
    layout, _ = pack(tensors)
    port = free_port()  # nothing listens there any more
    transfer = {
        "transfer": 1,
        "version": 7,
        "backend": "gloo",
        "address": "127.0.0.1",
        "port": port,
        "prefix": "transfer/1/",
        "timeout_s": 600.0,
        "layout": layout.to_json(),
    }
    started = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=rf"version 7: .* store at 127.0.0.1:{port} is unreach"
    ):
        receive_described(transfer, dict(tensors))
    assert time.monotonic() - started < 60


def test_a_version_whose_service_died_is_waited_for_again_not_read_from_disk(
    nccl_run: tuple[TrinityConfig, RunPaths],
) -> None:
    """The explorer chose the announced version 3, then its service died: loading it raises
    the error the loop answers by waiting for weights again, and the loaded model stays."""
    config, paths = nccl_run
    create_initial_model(config, paths)
    explorer = Explorer(config, paths)
    model = explorer.policy(0)
    with pytest.raises(WeightSyncError, match=r"version 3 are neither announced .* nor on disk"):
        explorer.policy(3)
    assert explorer.policy(0) is model


@pytest.mark.parametrize("explored", [3, 2], ids=["total_steps", "data_ends_early"])
def test_a_run_with_nccl_sync_trains_to_the_end(
    nccl_run: tuple[TrinityConfig, RunPaths], explored: int
) -> None:
    config, paths = nccl_run

    def engine_status() -> tuple[ServiceState, dict]:
        state = read_state(paths)
        assert state is not None
        with EngineClient(state.url, read_token(paths)) as client:
            return state, client.status()["weight_sync"]

    run = train_beside_explorer(config, explored, engine_status)
    (state, sync), versions, loop, reason = run.while_up, run.versions, run.loop, run.reason

    trainer = read_trainer_state(paths)
    assert trainer is not None and trainer.state == "finished" and trainer.step == explored
    assert versions == {step: step - 1 for step in range(1, explored + 1)}
    received = [t for t in sync["transfers"] if t["receiver"] == "explorer-0"]
    assert [t["version"] for t in received] == list(range(1, explored))
    assert all(t["ok"] for t in received), received
    assert sync["port"] == state.weight_sync_port and sync["versions"][-1] == explored
    assert loop.explorer.last_received is not None
    assert loop.explorer.last_received.version == explored - 1
    # nothing published per step; the final checkpoint's HF export is the last version on disk
    assert [d.step for d in scan_step_dirs(paths.weights)] == [0]
    assert latest_weights_version(paths) == explored
    final = checkpoint_dir(paths, explored) / "huggingface"
    assert weights_dir(paths, explored) == final
    assert not announce.announce_path(paths).exists()
    if explored < 3:
        assert "test data used up" in reason
