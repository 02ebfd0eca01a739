"""The engine service on N nodes: its configuration, launch, recipes, and two loopback "nodes"
that train like one node with the same ranks and resume each other's checkpoints."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from trinity_dagster.checkpoint.layout import weights_dir
from trinity_dagster.cli import main as cli_main
from trinity_dagster.config import ConfigError, TrinityConfig, config_from_dict, load_config
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import (
    SilentService,
    connect,
    find_service,
    launch_command,
    replace_silent,
    stop_service,
)
from trinity_dagster.service.recipes import RecipeOptions, k8s_manifest, slurm_script
from trinity_dagster.service_api.state import (
    ServiceState,
    advertised_host,
    ensure_token,
    read_state,
    write_state,
)
from trinity_dagster.testing import fill_buffer, free_port, pin_steps, tiny_config
from trinity_dagster.weight_sync.receiver import receive_weights

TWO_NODES = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"}
CLUSTER = {
    "megatron": {"tensor_model_parallel_size": 2, "data_parallel_size": 4},
    "model": {"num_attention_heads": 4, "num_query_groups": 2},
    "service": {
        "nnodes": 2,
        "rdzv_endpoint": "engine-0.engine-svc:29400",
        "allow_non_loopback": True,
    },
}


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    return str(err.value)


@pytest.mark.parametrize(
    ("service", "megatron", "key", "names"),
    [
        ({**TWO_NODES, "nproc_per_node": 2}, {"data_parallel_size": 2}, "service.nproc_per_node",
         ("service.nnodes (2)", "service.nproc_per_node (2) = 4", "data_parallel_size (2) = 2")),
        (TWO_NODES, {"data_parallel_size": 3}, "service.nnodes",
         ("2 nodes", "tensor_model_parallel_size (1)", "data_parallel_size (3) = 3")),
        ({"nproc_per_node": 2}, {}, "service.nproc_per_node",
         ("service.nnodes (1)", "= 1")),
    ],
)  # fmt: skip
def test_nodes_times_ranks_per_node_must_be_the_world_size(
    service: dict, megatron: dict, key: str, names: tuple[str, ...]
) -> None:
    batch = {"train_batch_size": 48}  # divisible by every data_parallel_size above
    message = _error({"service": service, "megatron": megatron, "buffer": batch})
    assert f"  {key}: " in message
    assert all(name in message for name in names), message


def test_rendezvous_endpoint_is_required_valid_and_loopback_unless_allowed() -> None:
    assert "service.rdzv_endpoint: required when service.nnodes > 1" in _error(
        {"service": {"nnodes": 2}, "megatron": {"data_parallel_size": 2}}
    )
    two = {"megatron": {"data_parallel_size": 2}}
    for bad in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":29400"):
        message = _error({**two, "service": {"nnodes": 2, "rdzv_endpoint": bad}})
        assert "service.rdzv_endpoint" in message and "host:port" in message, message
    remote = {"nnodes": 2, "rdzv_endpoint": "10.0.0.5:29400"}
    message = _error({**two, "service": remote})
    assert "service.rdzv_endpoint" in message and "service.allow_non_loopback" in message
    config_from_dict({**two, "service": {**remote, "allow_non_loopback": True}})
    assert "service.node_rank: 2 is not below service.nnodes (2)" in _error(
        {**two, "service": {**TWO_NODES, "node_rank": 2}}
    )


def _launch(service: dict[str, Any], node_rank: int | None = None, dp: int = 2) -> list[str]:
    config = config_from_dict({"service": service, "megatron": {"data_parallel_size": dp}})
    return launch_command(Path("/run/c.yaml"), config, node_rank)[1:]


def test_one_rank_runs_alone_and_more_ranks_on_one_node_under_the_loopback_agent() -> None:
    assert _launch({}, dp=1) == ["-m", "trinity_dagster.service.main", "-c", "/run/c.yaml"]
    assert _launch({}) == [
        "-m",
        "trinity_dagster.service.agent",
        "--nproc_per_node=2",
        "--nnodes=1",
        "-m",
        "trinity_dagster.service.main",
        "-c",
        "/run/c.yaml",
    ]


def test_n_node_launch_uses_c10d_and_node_0_hosts_the_rendezvous() -> None:
    first, other, unset = (_launch(TWO_NODES, rank, dp=4) for rank in (0, 1, None))
    common = {
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
    }
    for command in (first, other, unset):
        assert common <= set(command), command
        assert sum(arg.startswith("--rdzv-id=trinity-dagster-") for arg in command) == 1
    assert "--rdzv-conf=is_host=true" in first and "--rdzv-conf=is_host=false" in other
    assert not any(arg.startswith("--rdzv-conf") for arg in unset)
    assert first[-3:] == ["trinity_dagster.service.main", "-c", "/run/c.yaml"]


def _cluster_config(tmp_path: Path) -> tuple[TrinityConfig, Path]:
    file = tmp_path / "cluster.yaml"
    file.write_text(yaml.safe_dump({**CLUSTER, "run_root": "/shared/runs/r"}))
    return load_config(file), file


def _torchrun_options(command: list[str]) -> dict[str, str]:
    options = [arg.split("=", 1) for arg in command if arg.startswith("--")]
    return {name: value for name, value in options}


def test_slurm_recipe_is_a_valid_script_with_one_torchrun_task_per_node(tmp_path: Path) -> None:
    config, file = _cluster_config(tmp_path)
    script = slurm_script(config, file, RecipeOptions(gpus_per_node=4))
    path = tmp_path / "engine.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    sbatch = dict(
        line.removeprefix("#SBATCH ").split("=", 1)
        for line in script.splitlines()
        if line.startswith("#SBATCH ")
    )
    assert sbatch["--nodes"] == "2" and sbatch["--ntasks-per-node"] == "1"
    assert sbatch["--gpus-per-node"] == "4"
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    command = shlex.split(srun)
    torchrun = command[command.index("torchrun") :]
    options = _torchrun_options(torchrun)
    assert int(options["--nnodes"]) * int(options["--nproc-per-node"]) == 8  # tp 2 x dp 4
    assert options["--rdzv-backend"] == "c10d"
    assert options["--rdzv-endpoint"] == "engine-0.engine-svc:29400"
    assert torchrun[-4:] == ["-m", "trinity_dagster.service.main", "-c", str(file.resolve())]


def test_k8s_recipe_is_an_indexed_job_behind_the_headless_service_of_the_endpoint(
    tmp_path: Path,
) -> None:
    config, _ = _cluster_config(tmp_path)
    docs = list(yaml.safe_load_all(k8s_manifest(config, RecipeOptions(gpus_per_node=4))))
    kinds = {doc["kind"]: doc for doc in docs}
    assert sorted(kinds) == ["ConfigMap", "Job", "Service"]
    service, job = kinds["Service"], kinds["Job"]
    assert service["metadata"]["name"] == "engine-svc" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == 29400
    spec = job["spec"]
    assert job["metadata"]["name"] == "engine" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "engine-svc"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    options = _torchrun_options(container["command"])
    assert container["command"][0] == "torchrun"
    assert int(options["--nnodes"]) * int(options["--nproc-per-node"]) == 8
    assert options["--rdzv-endpoint"] == "engine-0.engine-svc:29400"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    shipped = yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"])
    assert config_from_dict(shipped) == config


def test_k8s_recipe_refuses_an_endpoint_that_names_no_pod(tmp_path: Path) -> None:
    config, _ = _cluster_config(tmp_path)
    config.service.rdzv_endpoint = "10.0.0.5:29400"
    with pytest.raises(ConfigError, match=r"service.rdzv_endpoint: .*JOB-0\.SERVICE:PORT"):
        k8s_manifest(config, RecipeOptions(gpus_per_node=0))


def test_join_and_recipes_refuse_a_one_node_config(tmp_path: Path, capsys) -> None:
    _, file = tiny_config(tmp_path)
    assert cli_main(["engine", "join", "-c", str(file), "--node-rank", "1"]) == 2
    assert "service.nnodes is 1" in capsys.readouterr().err
    assert cli_main(["engine", "recipe", "slurm", "-c", str(file)]) == 2
    assert "service.nnodes is 1" in capsys.readouterr().err


def test_state_of_a_rank_0_on_another_machine_is_judged_by_its_answer(tmp_path: Path) -> None:
    """Its pids mean nothing here: the state is neither cleared as dead nor signalled."""
    config, _ = tiny_config(tmp_path)
    paths = RunPaths.of(config.run_root)
    ensure_token(paths)
    elsewhere = ServiceState(
        pid=os.getpid(),  # a live local pid, which must not be signalled
        pgid=os.getpgid(0),
        launcher_pid=os.getppid(),
        host="127.0.0.1",
        port=free_port(),  # nothing answers
        world_size=2,
        config_hash="x",
        log_file="",
        node="another-machine",
    )
    write_state(paths, elsewhere)
    found = find_service(paths)
    assert isinstance(found, SilentService) and "on another-machine" in found.reason
    assert read_state(paths) == elsewhere
    assert replace_silent(paths, found) == []
    assert read_state(paths) is None


# --- two loopback nodes against one node ----------------------------------------------------

STEPS = 4  # checkpoint at step 2, where the layouts swap


def _layout(tmp_path: Path, root: Path, name: str, nodes: int) -> tuple[TrinityConfig, Path]:
    service = {"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"} if nodes == 2 else {}
    extra = {
        "run_root": str(root),
        "megatron": {"data_parallel_size": 2},
        "trainer": {"total_steps": STEPS, "save_interval": 2},
        "service": service,
        "synchronizer": {"sync_method": "nccl"},
    }
    return tiny_config(tmp_path / name, extra)


def _listening(processes: list[psutil.Process]) -> set[str]:
    found = set()
    for process in processes:
        for conn in process.net_connections("inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.add(conn.laddr.ip)
    return found


def _train(
    config: TrinityConfig, config_file: Path, steps: range, log: Path
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train `steps` on a service of the config's layout, save or sync the last; the metrics,
    and after the last step the weights this process received over the collective sync.

    Two nodes: this process starts node 0's agent (`connect`), a second process joins as
    node 1 (`engine join`); the rendezvous decides where rank 0 runs.
    """
    received: dict[str, torch.Tensor] = {}
    paths = RunPaths.of(config.run_root)
    join = None
    if config.service.nnodes == 2:
        cli = [sys.executable, "-m", "trinity_dagster.cli", "engine", "join", "-c"]
        with open(log, "ab") as out:
            join = subprocess.Popen(
                [*cli, str(config_file), "--node-rank", "1"], stdout=out, stderr=out
            )
    try:
        with connect(config) as client:
            assert client.status()["world_size"] == 2
            if join is not None:
                everything = psutil.Process().children(recursive=True)
                assert _listening(everything) == {"127.0.0.1"}
            metrics = [client.train_step(step)["metrics"] for step in steps]
            if steps[-1] == STEPS:
                client.publish_weights(STEPS)
                client.stage_weights(STEPS)  # and as an explorer on a third "machine" gets it
                published = load_file(weights_dir(paths, STEPS) / "model.safetensors")
                received = {name: torch.zeros_like(t) for name, t in published.items()}
                receive_weights(paths, STEPS, received, "explorer-elsewhere")
            else:
                client.save_checkpoint(steps[-1], block=True)
    finally:
        stop_service(paths)
        joined = None if join is None else _wait_or_kill(join, timeout_s=120)
    assert joined in (None, 0), log.read_text()[-3000:]
    return metrics, received


def _wait_or_kill(process: subprocess.Popen, timeout_s: float) -> int:
    """The exit status of `process`, killed if it still runs after `timeout_s`."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _run(tmp_path: Path, name: str, first: int, then: int) -> tuple[list[dict], dict]:
    """Steps 1-2 on `first` nodes, save; resume on `then` nodes for steps 3-4."""
    root = tmp_path / name / "run"
    config, file = _layout(tmp_path, root, f"{name}-{first}", first)
    fill_buffer(config, steps=STEPS)
    pin_steps(config, range(1, STEPS + 1))
    log = tmp_path / f"{name}-join.log"
    metrics, _ = _train(config, file, range(1, 3), log)
    config, file = _layout(tmp_path, root, f"{name}-{then}", then)
    later, received = _train(config, file, range(3, STEPS + 1), log)
    weights = load_file(weights_dir(RunPaths.of(config.run_root), STEPS) / "model.safetensors")
    assert received.keys() == weights.keys()
    for tensor_name, tensor in weights.items():
        assert received[tensor_name].equal(tensor), tensor_name
    return metrics + later, weights


def _deterministic(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/throughput"))}


@pytest.mark.slow
def test_two_nodes_train_like_one_and_resume_each_others_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 as 2 nodes x 1 rank and as 1 node x 2 ranks: the same losses and bit-identical
    weights (the same gloo all-reduce of two ranks either way), each layout resuming the
    other's step-2 checkpoint; the final weights reach this process over the collective sync
    (`sync_method: nccl`, gloo) as they were published, from rank 0 on whichever node."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun sets it for 2 ranks a node, not 1
    two_then_one, two_first_weights = _run(tmp_path, "a", first=2, then=1)
    one_then_two, one_first_weights = _run(tmp_path, "b", first=1, then=2)
    for step, (a, b) in enumerate(zip(two_then_one, one_then_two, strict=True), start=1):
        assert _deterministic(a) == _deterministic(b), step
    assert two_then_one[0]["actor/pg_loss"] != two_then_one[-1]["actor/pg_loss"]
    assert two_first_weights.keys() == one_first_weights.keys()
    for name, tensor in one_first_weights.items():
        assert two_first_weights[name].equal(tensor), name


def test_a_wildcard_bind_is_recorded_as_the_node_rank_0_runs_on() -> None:
    """Rank 0 may land on any node: clients elsewhere reach it by that node's name."""
    for wildcard in ("0.0.0.0", "::"):
        assert advertised_host(wildcard) == socket.getfqdn()
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("node3.cluster") == "node3.cluster"
