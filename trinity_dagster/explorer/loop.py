"""The built-in explorer as one long-lived loop over explore steps (the trainer loop's peer).

For each explore step E it waits for the weights E may use, explores (or writes
demonstrations during the SFT warm-up, which need no weights), writes the experiences and
reports the step. The model stays loaded between steps. Weights:
- `sync_style: fixed`: E runs with at least version `explorer_weights_version(E)`
  (`sync_interval`, `sync_offset`);
- `sync_style: explorer_driven`: after every `sync_interval` explore steps it asks the
  trainer for newer weights (`trainer.sync_requests`) and goes on once answered;
- `sync_style: trainer_driven`: as `fixed` with weights as files or in shared memory; with
  `nccl`, at its sync points it takes the newest version the trainer has ready, if any,
  without waiting;
- `sync_style: fully_async`: it never waits, and each step takes the newest version.
It waits at most `synchronizer.sync_timeout` seconds for weights (without a limit while the
user paused training), and stops when the trainer stopped: normally if the trainer
finished, with `TrainerStoppedError` if it failed. When the
task set is used up (`buffer.total_epochs`) or every explore step the trainer needs is done,
it marks the end of data, so a trainer waiting for more stops cleanly. It beats a heartbeat
(`explorer.heartbeat`) at every step and while it waits, so a frozen step is told from a
slow trainer.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Collection
from statistics import fmean
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trinity_dagster.buffer.room import BufferRoom
from trinity_dagster.buffer.validation import INPUT_SCHEMA
from trinity_dagster.buffer.writer import ExperienceWriter
from trinity_dagster.checkpoint.rules import (
    explore_steps_needed,
    explorer_waits_for_weights,
    explorer_weights_version,
    is_explorer_sync_point,
)
from trinity_dagster.checkpoint.shm_weights import newest_weights_version
from trinity_dagster.config import SyncStyle, TrinityConfig
from trinity_dagster.explorer.demonstrations import demonstration_rows
from trinity_dagster.handoff.control import paused_by
from trinity_dagster.handoff.end_of_data import mark_end_of_data
from trinity_dagster.handoff.heartbeat import BUILTIN_EXPLORER_ID, Heartbeat
from trinity_dagster.handoff.sync_requests import is_answered, request_sync
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.handoff.wakeup import EXPLORER, Wakeup
from trinity_dagster.paths import RunPaths
from trinity_dagster.tasks import load_taskset
from trinity_dagster.torch_threads import explorer_torch_threads
from trinity_dagster.weight_sync.announce import announced_version
from trinity_dagster.weight_sync.errors import WeightSyncError

if TYPE_CHECKING:
    from trinity_dagster.explorer.explorer import Explorer

log = logging.getLogger(__name__)

RECEIVE_TRIES = 3
ALREADY_IN_TABLE = "already in the experiences table"


def step_timings(marks: list[float]) -> dict[str, float]:
    """Seconds of an explore step's parts from its time marks: waiting for weights (absent
    for demonstrations), loading them and generating (`time/generate`), writing experiences."""
    names = ("time/wait_weights", "time/generate", "time/write_experiences")
    parts = [b - a for a, b in itertools.pairwise(marks)]
    return dict(zip(names[-len(parts) :], parts, strict=True))


def explorer_threads_here(config: TrinityConfig) -> int:
    """`explorer_torch_threads` for the cores this process may use (the loop sets them when
    it loads torch)."""
    return explorer_torch_threads(config, len(os.sched_getaffinity(0)))


def steps_available(config: TrinityConfig) -> int | None:
    """Explore steps the task set allows under `buffer.total_epochs` (None: no end)."""
    epochs = config.buffer.total_epochs
    if epochs is None:
        return None
    taskset = load_taskset(config.explorer.taskset, config.explorer.seed)
    return epochs * len(taskset) // config.explorer.tasks_per_step


class TrainerStoppedError(RuntimeError):
    """The trainer failed, so the weights this explorer waits for will never come."""


class ExplorerLoop:
    """Explores steps in order with one loaded model; `run` returns why it stopped.

    Torch, the initial model and the explorer's model are loaded at the first step that
    generates: the SFT warm-up's demonstrations need only the tokenizer, so they are written
    (and training starts) while a process that has not loaded them yet would still import.
    """

    def __init__(
        self,
        config: TrinityConfig,
        explorer_id: str = BUILTIN_EXPLORER_ID,
        on_step: Callable[[int, dict[str, Any]], None] = lambda step, metadata: None,
    ) -> None:
        self.config = config
        self.paths = RunPaths.of_config(config)
        self.explorer_id = explorer_id
        self.on_step = on_step
        self._explorer: Explorer | None = None
        # one writer for the whole loop: it reads each data file's eids once, not every step
        self._writing_version = 0
        self._writer = ExperienceWriter(
            config, known_versions=lambda: set(range(self._writing_version + 1))
        )
        self._started_at = time.time()
        self._held: int | None = None  # the weights version of the last explored step
        self._heartbeat = Heartbeat(self.paths, explorer_id)
        self._wakeup = Wakeup(self.paths.wakeup, EXPLORER, explorer_id)
        self._room = BufferRoom(config)

    @property
    def explorer(self) -> Explorer:
        """The explorer that generates; built (torch loaded, its threads set, the initial
        model created if absent) on first use."""
        if self._explorer is None:
            import torch

            from trinity_dagster.checkpoint.initial_weights import create_initial_model
            from trinity_dagster.explorer.explorer import Explorer

            torch.set_num_threads(explorer_threads_here(self.config))
            create_initial_model(self.config, self.paths)
            self._explorer = Explorer(self.config, self.paths, self.explorer_id)
        return self._explorer

    def run(self, first: int, last: int | None, done: Collection[int] = ()) -> str:
        """Explore steps `first..last` (None: until the task set is used up or the trainer
        finished), skipping those in `done`; returns why it stopped."""
        needed = explore_steps_needed(self.config)
        available = steps_available(self.config)
        steps = itertools.count(first) if last is None else range(first, last + 1)
        for step in steps:
            if step in done:
                continue
            self._heartbeat.beat(force=True)
            if available is not None and step > available:
                reason = (
                    f"the task set is used up after {available} explore steps "
                    f"(buffer.total_epochs {self.config.buffer.total_epochs})"
                )
                mark_end_of_data(self.paths, self.explorer_id, reason)
                return reason
            stopped = self.explore_step(step)
            if stopped is not None:
                return stopped
        assert last is not None  # an open-ended loop ends only inside
        if needed is not None and last >= needed:
            reason = f"explored all {needed} steps that trainer.total_steps needs"
            mark_end_of_data(self.paths, self.explorer_id, reason)
            return reason
        return f"explored up to step {last}, the end of the requested range"

    def close(self) -> None:
        """Stop listening for the trainer's wake-ups (a later `run` polls only)."""
        self._wakeup.close()

    def explore_step(self, step: int) -> str | None:
        """Explore one step and report it; returns why the loop stops, or None to go on."""
        config = self.config
        demonstrations = step <= config.trainer.sft_warmup_steps
        room_wait_from = time.perf_counter()
        stopped = self._wait_for_room(step, demonstrations)
        if stopped:
            return stopped
        marks = [time.perf_counter()]
        if demonstrations:
            version = self._latest_version()
            rows = demonstration_rows(
                config, config.buffer.train_batch_size, seed=step, model_version=version
            )
        else:
            explored = self._explore(step, marks)
            if isinstance(explored, str):
                return explored
            version, rows = explored
        marks.append(time.perf_counter())
        self._writing_version = self._held = version
        report = self._writer.write(rows_for_writer(rows), explore_step=step)  # wakes trainers
        marks.append(time.perf_counter())
        self._room.wrote(report)
        if report.written == 0 and not all(ALREADY_IN_TABLE in str(r) for r in report.reasons):
            raise ValueError(
                f"explore step {step}: every experience was quarantined: "
                + "; ".join(str(r) for r in report.reasons[:5])
            )
        rewards = [row["reward"] for row in rows]
        self.on_step(
            step,
            {
                "weights_version": version,
                "demonstrations": demonstrations,
                **report.as_metadata(),
                "already_written": report.written == 0,
                "reward_mean": fmean(rewards),
                "accuracy": fmean(1.0 if r >= 1.0 else 0.0 for r in rewards),
                **step_timings(marks),
                **self._room_metadata(marks[0] - room_wait_from),
            },
        )
        if not demonstrations and self._asks_for_sync(step):
            return self._request_sync(version)
        return None

    def _explore(self, step: int, marks: list[float]) -> tuple[int, list[dict[str, Any]]] | str:
        """(weights version, rows) of explore step E, or why the loop stops.

        A collective transfer that fails (the engine service died before or during it, a
        damaged bucket) is tried again with the weights then available, up to `RECEIVE_TRIES` times.
        """
        for attempt in range(1, RECEIVE_TRIES + 1):
            waited = self._wait_for_weights(step)
            if isinstance(waited, str):
                return waited
            if attempt == 1:
                marks.append(time.perf_counter())
            try:
                return waited, self.explorer.explore(step, waited)
            except WeightSyncError as err:
                if attempt == RECEIVE_TRIES:
                    raise
                log.warning("explore step %d: %s; waiting for weights again", step, err)
        raise AssertionError("RECEIVE_TRIES is at least 1")

    def _asks_for_sync(self, step: int) -> bool:
        sync = self.config.synchronizer
        return sync.sync_style is SyncStyle.EXPLORER_DRIVEN and step % sync.sync_interval == 0

    def _wait_for_weights(self, step: int) -> int | str:
        """The weights version step E runs with, or why the loop stops.

        Explorers that wait (`explorer_waits_for_weights`) take the newest version once the
        one step E needs is there. Under `fully_async` a step never waits and takes the
        newest version; under `trainer_driven` with `nccl` the explorer takes the newest
        version at its sync points and keeps the one it holds in between. In every style a
        step waits rather than take a version older than the one held: under `nccl` or
        `memory` the newest version dips while a killed engine service restarts.
        """
        sync = self.config.synchronizer
        keeps = sync.sync_style is SyncStyle.TRAINER_DRIVEN and not explorer_waits_for_weights(sync)
        if keeps and self._held is not None and not is_explorer_sync_point(step, sync):
            return self._held
        needed = self._held or 0
        if explorer_waits_for_weights(sync):
            needed = max(
                needed,
                explorer_weights_version(
                    step, sync_interval=sync.sync_interval, sync_offset=sync.sync_offset
                ),
            )
        return (
            self._wait(
                lambda: self._latest_version() >= needed,
                f"explore step {step} needs weights version >= {needed}",
            )
            or self._latest_version()
        )

    def _wait_for_room(self, step: int, demonstrations: bool) -> str:
        """Wait until the rows of step `step` fit under `buffer.capacity`; "" then, or why
        the loop stops. The trainer wakes this explorer when it pins a batch."""
        rows = self.config.explore_step_rows(demonstrations=demonstrations)
        return self._wait(
            lambda: self._room.fits(rows),
            f"explore step {step} needs room for {rows} experiences in the buffer "
            f"(buffer.capacity {self.config.buffer.capacity})",
        )

    def _room_metadata(self, waited_s: float) -> dict[str, Any]:
        """The buffer's fill and the wait for room, when `buffer.capacity` bounds it."""
        if self.config.buffer.capacity is None:
            return {}
        return {"buffer_unconsumed": self._room.unconsumed, "time/wait_room": waited_s}

    def _latest_version(self) -> int:
        """The newest weights version this explorer can load (0 if none is published yet)."""
        method = self.config.synchronizer.sync_method
        newest = newest_weights_version(self.paths, memory=method == "memory") or 0
        if method == "nccl":
            return max(newest, announced_version(self.paths) or 0)
        return newest

    def _request_sync(self, have_version: int) -> str | None:
        """Ask the trainer for newer weights and wait for the answer (explorer-driven)."""
        request = request_sync(self.paths, self.explorer_id, have_version)
        stopped = self._wait(
            lambda: is_answered(request),
            f"the sync request of explorer {self.explorer_id} (holding version {have_version})",
        )
        return stopped or None

    def _wait(self, ready: Callable[[], bool], what: str) -> str:
        """Wait until `ready()`; returns "" then, or why the loop stops (trainer finished).

        While training is paused by the user the wait has no deadline."""
        deadline = time.monotonic() + self.config.synchronizer.sync_timeout
        while not ready():
            self._heartbeat.beat()  # waiting is no hang
            state = read_trainer_state(self.paths)
            if state is not None and state.state == "failed":
                raise TrainerStoppedError(f"{what}, but the trainer failed: {state.reason}")
            if state is not None and state.state == "finished" and self._finished_now(state.step):
                return f"the trainer finished ({state.reason})"
            if time.monotonic() > deadline and paused_by(self.paths) is not None:
                deadline = time.monotonic() + self.config.synchronizer.sync_timeout
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}; none came within synchronizer.sync_timeout "
                    f"({self.config.synchronizer.sync_timeout:g} s)"
                )
            self._wakeup.wait()
        return ""

    def _finished_now(self, step: int) -> bool:
        """A finished state counts unless it is left from a shorter run on this root."""
        state = read_trainer_state(self.paths)
        total = self.config.trainer.total_steps
        return state is not None and (
            state.updated_at >= self._started_at or (total is not None and step >= total)
        )


def rows_for_writer(rows: list[dict[str, Any]]) -> pa.Table | list[dict[str, Any]]:
    """The explorer's rows as one table for the writer, which checks a table column by column
    (256 rows: 0.9 ms with the conversion, where checking row by row takes 8 ms); the rows as
    they are where Arrow cannot hold one of them, so that the writer names the row and why."""
    try:
        return pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return rows
