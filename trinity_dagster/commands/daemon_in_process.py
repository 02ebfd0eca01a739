"""The Dagster daemon of `trinity-dagster run`, run by the command's own process.

Dagster's daemon controller runs the daemons (sensors, schedules, the queued-run coordinator,
run monitoring, backfills, ...) as threads of the process that enters it; `dagster-daemon run`
is that controller in a process of its own. The command imports Dagster and opens the run's
instance anyway, so it enters the same controller on that instance and the code servers'
workspace itself: one process fewer for a training (the daemon's interpreter, Dagster's
imports and a second instance). What the daemon logs goes to `logs/dagster-daemon.log`, as
when it was a process.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trinity_dagster.commands.errors import TrainingRunError

if TYPE_CHECKING:
    from dagster import DagsterInstance

LOG_LEVEL = "info"  # `dagster-daemon run`'s default


class DaemonInProcess:
    """Dagster's daemon controller entered on `instance` and the workspace file `workspace`
    (the code servers must serve already: a location unreachable at the first load stays in
    error until Dagster's next reload), its threads logging to `log_file`."""

    def __init__(self, instance: DagsterInstance, workspace: Path, log_file: Path) -> None:
        from dagster._core.workspace.load_target import WorkspaceFileTarget
        from dagster._daemon.controller import (
            DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
            HEARTBEAT_CHECK_INTERVAL,
            daemon_controller_from_instance,
        )

        self.log_file = log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self._stack = contextlib.ExitStack()
        try:
            log = self._stack.enter_context(open(log_file, "a", buffering=1))  # noqa: SIM115
            # Dagster's log handler writes to `sys.stdout` as it is when the controller is
            # entered: the log file, not the command's output
            with contextlib.redirect_stdout(log):
                self._controller = self._stack.enter_context(
                    daemon_controller_from_instance(
                        instance,
                        workspace_load_target=WorkspaceFileTarget(paths=[str(workspace)]),
                        log_level=LOG_LEVEL,
                    )
                )
        except BaseException:
            self._stack.close()
            raise
        self._instance = instance
        # as `dagster-daemon run`: heartbeats read from the second heartbeat interval on
        self._first_heartbeat_check_s = 2 * DEFAULT_HEARTBEAT_INTERVAL_SECONDS
        self._heartbeat_check_every_s = HEARTBEAT_CHECK_INTERVAL
        self._started_at = self._workspace_loaded_at = self._heartbeats_read_at = time.time()

    def check(self) -> None:
        """What `dagster-daemon run` does between its sleeps: fail if a daemon's thread has
        stopped (`TrainingRunError`), reload the workspace once a minute, and once a minute,
        from the second heartbeat interval on, log a warning naming the daemons whose
        heartbeats are late."""
        try:
            self._controller.check_daemon_threads()
        except Exception as err:
            raise TrainingRunError(f"dagster-daemon: {err}; see {self.log_file}") from None
        self._workspace_loaded_at = self._controller.check_workspace_freshness(
            self._workspace_loaded_at
        )
        now = time.time()
        if (
            not self._instance.daemon_skip_heartbeats_without_errors
            and now - self._started_at >= self._first_heartbeat_check_s
            and now - self._heartbeats_read_at >= self._heartbeat_check_every_s
        ):
            self._controller.check_daemon_heartbeats()
            self._heartbeats_read_at = time.time()

    def stop(self) -> None:
        """Stop the daemons' threads (each finishes what it is doing) and the controller."""
        self._stack.close()
