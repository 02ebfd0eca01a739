"""What `trinity-dagster run` starts and stops: the run's instance settings, the code servers
with their run workers, the daemon, the engine service's processes, and the stop signals that
end them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trinity_dagster.commands.errors import StoppedBySignal, TrainingRunError
from trinity_dagster.config import CONFIG_ENV_VAR, TrinityConfig
from trinity_dagster.dagster_instance import write_instance_yaml
from trinity_dagster.paths import RunPaths

if TYPE_CHECKING:
    import psutil

    from trinity_dagster.commands.daemon_in_process import DaemonInProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def restore_stop_signals() -> None:
    """SIGINT and SIGTERM act again where the launching shell left them ignored (a script's
    background job ignores SIGINT; `trap '' TERM`): an ignored signal is inherited by every
    process started from here, which then outlives its stop request."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ignore_stop_signals() -> None:
    """From here on SIGINT and SIGTERM do nothing (so that they cannot cut a cleanup short)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


# The stop signal received within `stop_signals_raise`: Python ignores an exception raised in
# a garbage-collector callback, so a handler's raise can be lost, and the watch loop raises it.
_received: list[int] = []
_deferring: list[bool] = []  # inside `stop_signals_deferred`: the raise waits for its end


def _raise_stopped(signum: int, frame: Any) -> None:
    """The handler of SIGINT and SIGTERM within `stop_signals_raise`."""
    ignore_stop_signals()
    _received.append(signum)
    if not _deferring:
        raise StoppedBySignal(signum)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Within: a stop signal is recorded, and raised only once the block has ended, so that
    a process the block starts is always known to the clean-up (a raise inside
    `subprocess.Popen` would leave the child running, its handle never returned)."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    raise_if_stopped()


def raise_if_stopped() -> None:
    """Raise `StoppedBySignal` for a stop signal received whose handler's raise was lost."""
    if _received:
        raise StoppedBySignal(_received[0])


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within: the first SIGINT or SIGTERM raises `StoppedBySignal`, later ones are ignored,
    and a raise Python drops (in a garbage-collector callback) is not reported on stderr;
    the handlers from before come back at the end."""
    _received.clear()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    previous_hook = sys.unraisablehook

    def quiet_lost_stop(unraisable: Any) -> None:
        # a raise lost in a garbage-collector callback: recorded, the watch loop raises it,
        # so Python's "Exception ignored in ..." report would only break the one-line output
        if not isinstance(unraisable.exc_value, StoppedBySignal):
            previous_hook(unraisable)

    sys.unraisablehook = quiet_lost_stop
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()


def find_workspace(workspace: str | Path | None) -> Path:
    """The `workspace.yaml` that loads the code location (given, in the cwd, or the repo's)."""
    candidates = [Path(workspace)] if workspace else [Path.cwd() / "workspace.yaml"]
    if workspace is None:
        candidates.append(REPO_ROOT / "workspace.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise TrainingRunError(
        f"no Dagster workspace at {', '.join(str(c) for c in candidates)}: run from the "
        "trinity-dagster repository root or pass --workspace PATH/workspace.yaml"
    )


def prepare_instance(config: TrinityConfig) -> Path:
    """Write the run's config and instance settings; point this process's Dagster at them."""
    paths = RunPaths.of_config(config)
    paths.root.mkdir(parents=True, exist_ok=True)
    config_file = paths.config_file
    config_file.write_text(config.to_yaml())
    write_instance_yaml(paths.dagster_home, config.dagster.postgres_url, replace=True)
    os.environ[CONFIG_ENV_VAR] = str(config_file)
    os.environ["DAGSTER_HOME"] = str(paths.dagster_home)
    return config_file


def dagster_dev_command(config: TrinityConfig, config_file: Path, workspace: Path) -> str:
    """The command that opens this run's instance in the Dagster UI."""
    paths = RunPaths.of_config(config)
    return (
        f"cd {workspace.parent} && DAGSTER_HOME={paths.dagster_home} "
        f"{CONFIG_ENV_VAR}={config_file} {Path(sys.executable).parent / 'dagster'} dev "
        f"-w {workspace.name} -h 127.0.0.1 -p 3000"
    )


def stop_sessions(
    servers: Sequence[subprocess.Popen], grace: Callable[[], None] = lambda: None
) -> None:
    """Stop the code servers, each started in a session of its own, with everything they
    started there (a server's run workers): SIGTERM to every session, then `grace()` (the
    daemon's stop), then SIGKILL to what is left. A code server's graceful stop waits for
    calls the stopped daemon no longer makes."""
    for process in servers:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    grace()
    for process in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def engine_processes(paths: RunPaths) -> list[psutil.Process]:
    """The engine service agents and ranks on this machine started for this run root, found
    by the config file on their command line (one still starting has no state file yet)."""
    import psutil

    from trinity_dagster.service.processes import AGENT_MODULE, RANK_MODULE

    config_file = str(paths.service_config)
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if config_file in cmdline and not {AGENT_MODULE, RANK_MODULE}.isdisjoint(cmdline):
            found.append(process)
    return found


def stop_run(
    daemon: DaemonInProcess | None, servers: Sequence[subprocess.Popen], paths: RunPaths
) -> None:
    """Stop what a training run started: the code servers with their run workers and the
    daemon (those that got started; the workers have the daemon's stop to end on SIGTERM),
    then the run root's engine service, cleanly if it answers, and any of its processes
    left here."""
    from trinity_dagster.service.launcher import STOP_GRACE_S, stop_service
    from trinity_dagster.service.processes import end_processes

    stop_sessions(servers, grace=daemon.stop if daemon is not None else lambda: None)
    stop_service(paths)
    # twice: a rank that its agent started as the agent was being stopped may still be there
    for _ in range(2):
        end_processes(engine_processes(paths), grace_s=STOP_GRACE_S)
