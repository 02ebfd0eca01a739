"""The code servers `trinity-dagster run` starts itself and the workspace it gives the daemon."""

from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import WorkspaceFileTarget

from tests.support.dagster_dev import REPO_ROOT
from trinity_dagster.commands.code_server import (
    exited_code_server,
    remove_sockets,
    start_code_servers,
    wait_until_serving,
)
from trinity_dagster.commands.daemon_control import stop_sessions
from trinity_dagster.commands.errors import TrainingRunError
from trinity_dagster.dagster_instance import write_instance_yaml
from trinity_dagster.graph_names import ROLLOUTS_JOB
from trinity_dagster.paths import RunPaths


def test_the_daemons_workspace_loads_the_code_location_from_the_server_started_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = RunPaths.of(tmp_path / "run")
    write_instance_yaml(paths.dagster_home)
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    servers = start_code_servers(paths, REPO_ROOT / "workspace.yaml")
    try:
        (server,) = servers.processes
        wait_until_serving(servers, paths)
        entries = yaml.safe_load(servers.workspace.read_text())["load_from"]
        assert entries == [
            {"grpc_server": {"socket": str(servers.sockets[0]), "location_name": "trinity_dagster"}}
        ]
        with (
            dg.DagsterInstance.get() as instance,
            WorkspaceProcessContext(
                instance, WorkspaceFileTarget(paths=[str(servers.workspace)])
            ) as context,
        ):
            location = context.create_request_context().get_code_location("trinity_dagster")
            (repository,) = location.get_repositories().values()
            assert repository.has_job(ROLLOUTS_JOB)
        assert exited_code_server(servers) is None
    finally:
        stop_sessions(servers.processes)
        remove_sockets(servers)
    assert exited_code_server(servers) is server
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == "zombie"
    assert not servers.sockets_dir.exists()


def test_a_code_server_that_exits_while_starting_is_named_with_its_log(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        yaml.safe_dump(
            {
                "load_from": [
                    {
                        "python_module": {
                            "module_name": "assets.definitions",
                            "executable_path": "/bin/false",  # exits at once
                            "location_name": "broken",
                        }
                    }
                ]
            }
        )
    )
    servers = start_code_servers(paths, workspace)
    try:
        with pytest.raises(TrainingRunError, match="code server exited with 1") as raised:
            wait_until_serving(servers, paths, timeout_s=30)
        assert str(paths.code_server_log) in str(raised.value)
    finally:
        stop_sessions(servers.processes)
        remove_sockets(servers)


def test_a_grpc_server_of_the_workspace_is_passed_on_and_not_started(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    workspace = tmp_path / "workspace.yaml"
    entry = {"grpc_server": {"location_name": "elsewhere", "host": "127.0.0.1", "port": 4266}}
    workspace.write_text(yaml.safe_dump({"load_from": [entry]}))
    servers = start_code_servers(paths, workspace)
    remove_sockets(servers)
    assert servers.processes == []
    assert yaml.safe_load(servers.workspace.read_text())["load_from"] == [entry]
