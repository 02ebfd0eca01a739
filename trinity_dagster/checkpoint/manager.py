"""Full checkpoints: saved (in the background or blocking), finalized with a manifest, resumed.

A save writes into a hidden temp directory `.global_step_N.tmp-<config hash>/`: the HF export
(if asked), then the provider's state. When the provider's save is done, every file is hashed
and fsynced (on a helper thread, so a background save does not hold the train loop for it),
then the manifest is written last, the directory is renamed to `global_step_N/` (a complete
checkpoint of that step already there is kept), `latest_checkpointed_iteration.txt` moves
forward and retention runs. Background saves are finalized by `poll()` / `wait()` /
`wait_all()`, which also raise the errors of failed saves. Under torch.distributed every rank
calls the same methods in the same order (the provider's saves are collective); only rank 0
hashes and writes manifests and markers, and whether it is done is rank 0's answer, broadcast.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from trinity_dagster.checkpoint.hf_dir import hf_dir_written
from trinity_dagster.checkpoint.layout import (
    HF_SUBDIR,
    checkpoint_dir,
    discard_dir,
    scan_step_dirs,
    scratch_dir,
)
from trinity_dagster.checkpoint.manifest import (
    CorruptCheckpointError,
    Manifest,
    build_manifest,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from trinity_dagster.checkpoint.markers import CheckpointMonitor
from trinity_dagster.checkpoint.protocols import SaveHandle, StateProvider
from trinity_dagster.checkpoint.publish import checkpoint_sync_dir
from trinity_dagster.checkpoint.retention import is_complete, prune_checkpoints
from trinity_dagster.checkpoint.rules import sft_model_step
from trinity_dagster.config import TrinityConfig
from trinity_dagster.faults import fault_point
from trinity_dagster.files import fsync_dir
from trinity_dagster.paths import RunPaths

log = logging.getLogger(__name__)

T = TypeVar("T")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed; the message names the step and the directory."""


@dataclass
class SaveTicket:
    """One checkpoint save: pending until finalized, then `manifest` is set (on rank 0).

    A pending save is first writing (`handle` not done), then hashing (`hashing` running).
    """

    step: int
    directory: Path
    tmp_dir: Path
    hf: bool
    serves_as_sync: bool
    sampler_state: dict[str, Any]
    handle: SaveHandle | None = field(repr=False, default=None)
    hashing: Future[Manifest] | None = field(repr=False, default=None)
    written: bool = False
    finished: bool = False
    manifest: Manifest | None = None


def _dist_rank_and_size() -> tuple[int, int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank0(value: T) -> T:
    """`value` as rank 0 has it, on every rank (identity without torch.distributed)."""
    _, size = _dist_rank_and_size()
    if size == 1:
        return value
    dist = sys.modules["torch.distributed"]
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def find_complete(
    paths: RunPaths, *, checksums: bool = True
) -> tuple[tuple[int, Path] | None, list[str]]:
    """(step, directory) of the newest checkpoint that verifies (or None), and the rejected ones.

    Each rejected `global_step_N/` newer than the one found is logged as a warning and listed
    as `global_step_N (why)`.
    """
    rejected = []
    finals = [d for d in scan_step_dirs(paths.checkpoints) if d.kind == "final"]
    for entry in reversed(finals):
        try:
            verify_checkpoint(entry.path, checksums=checksums)
        except CorruptCheckpointError as err:
            log.warning("skipping checkpoint %s: %s", entry.path, err)
            rejected.append(f"{entry.path.name} ({err})")
            continue
        return (entry.step, entry.path), rejected
    return None, rejected


def latest_complete(paths: RunPaths, *, checksums: bool = True) -> tuple[int, Path] | None:
    """(step, directory) of the newest checkpoint that verifies, or None (see find_complete)."""
    return find_complete(paths, checksums=checksums)[0]


def _no_complete_checkpoint(paths: RunPaths, rejected: list[str]) -> Exception:
    """The error for a load that found no complete checkpoint, listing each one it rejected.

    FileNotFoundError if there was none at all, else CorruptCheckpointError.
    """
    if not rejected:
        return FileNotFoundError(
            f"no complete checkpoint under {paths.checkpoints}: no global_step_N/ directory"
        )
    return CorruptCheckpointError(
        f"no complete checkpoint under {paths.checkpoints}; tried {len(rejected)}: "
        + "; ".join(rejected)
    )


class CheckpointManager:
    """Saves, finalizes, verifies, loads and prunes the full checkpoints of one run.

    Not thread-safe: call it from the thread that drives training.
    """

    def __init__(
        self,
        config: TrinityConfig,
        paths: RunPaths,
        provider: StateProvider,
        *,
        writer: bool | None = None,
    ) -> None:
        self.config = config
        self.paths = paths
        self.provider = provider
        self.writer = _dist_rank_and_size()[0] == 0 if writer is None else writer
        self._config_hash = config.resolved_hash()
        self._pending: dict[int, SaveTicket] = {}
        self._helper: ThreadPoolExecutor | None = None
        self._retention: Future[Any] | None = None
        self._hashed: set[Path] = set()  # installed by this manager from the files it wrote
        self.markers = CheckpointMonitor(paths)

    # --- saving ----------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        sampler_state: dict[str, Any] | None = None,
        hf: bool = False,
        block: bool = False,
        serves_as_sync: bool = False,
    ) -> SaveTicket:
        """Save the provider's state as checkpoint `step`.

        `hf` adds a `huggingface/` export; `serves_as_sync` makes that export the published
        weights once the checkpoint is complete (needs `hf`). `block` returns only when this
        and every earlier save are complete; otherwise the save runs in the background.
        """
        self.poll()
        self._check_retention(block=True)  # it must know every temp directory in use
        if step != self.provider.step:
            raise ValueError(
                f"cannot save checkpoint of step {step}: the engine is at step {self.provider.step}"
            )
        if step in self._pending:
            raise ValueError(f"a save of step {step} is already in progress")
        if serves_as_sync and not hf:
            raise ValueError(f"step {step}: a save that serves as the sync must export HF weights")
        try:
            json.dumps(sampler_state or {})
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"sampler_state of step {step} is not JSON-serializable: {err}"
            ) from None
        ticket = SaveTicket(
            step=step,
            directory=checkpoint_dir(self.paths, step),
            tmp_dir=scratch_dir(self.paths.checkpoints, step, tag=self._config_hash),
            hf=hf,
            serves_as_sync=serves_as_sync,
            sampler_state=dict(sampler_state or {}),
        )
        if self.writer:
            self.markers.register_thread_count(
                step,
                checkpoint_thread_count=1,
                state_dict_thread_count=1 if serves_as_sync else 0,
            )
            self.markers.notify_started(step)
            if serves_as_sync:
                self.markers.notify_started(step, is_state_dict=True)
        if self._already_complete(ticket):
            log.info("checkpoint %s is already complete; not saving it again", ticket.directory)
            if self.writer:
                ticket.manifest = read_manifest(ticket.directory)
                self._after_install(ticket)
            ticket.finished = True
            return ticket
        if self.writer:
            if ticket.tmp_dir.exists():
                shutil.rmtree(ticket.tmp_dir)
            ticket.tmp_dir.mkdir(parents=True)
        try:
            if hf:
                self.provider.export_hf(ticket.tmp_dir / HF_SUBDIR)
            ticket.handle = self.provider.save_state(ticket.tmp_dir, background=not block)
            fault_point("checkpoint_write", step)
        except BaseException:
            if self.writer:
                shutil.rmtree(ticket.tmp_dir, ignore_errors=True)
            raise
        self._pending[step] = ticket
        if block:
            self.wait_all()
        return ticket

    def _already_complete(self, ticket: SaveTicket) -> bool:
        return _from_rank0(self._satisfies(ticket.directory, ticket))

    @staticmethod
    def _satisfies(directory: Path, ticket: SaveTicket) -> bool:
        """Whether `directory` is a complete checkpoint with everything `ticket` asks for."""
        return is_complete(directory) and (not ticket.hf or hf_dir_written(directory / HF_SUBDIR))

    def is_pending(self, step: int) -> bool:
        """Whether a save of `step` was started and is not finalized yet."""
        return step in self._pending

    def pending_steps(self) -> list[int]:
        """Steps whose saves are not finalized yet, ascending."""
        return sorted(self._pending)

    def poll(self) -> list[SaveTicket]:
        """Finalize the background saves that are done; raise the error of a failed one."""
        self._check_retention(block=False)
        finished = []
        for step in self.pending_steps():
            ticket = self._pending[step]
            assert ticket.handle is not None
            if not ticket.written and ticket.handle.done():
                self._written(ticket)
            if ticket.written and _from_rank0(ticket.hashing is None or ticket.hashing.done()):
                self._complete(ticket)
                finished.append(ticket)
        return finished

    def wait(self, step: int) -> SaveTicket | None:
        """Block until the save of `step` is finalized (None if none is pending)."""
        ticket = self._pending.get(step)
        if ticket is None:
            return None
        if not ticket.written:
            self._written(ticket)
        self._complete(ticket)
        return ticket

    def wait_all(self) -> None:
        """Finalize every pending save; raise the first error after waiting for all of them."""
        first_error: BaseException | None = None
        for step in self.pending_steps():
            try:
                self.wait(step)
            except Exception as err:
                first_error = first_error or err
        try:
            self._check_retention(block=True)
        except Exception as err:
            first_error = first_error or err
        if first_error is not None:
            raise first_error

    def _written(self, ticket: SaveTicket) -> None:
        """The provider's save is done: finish it, then hash its files on the helper thread."""
        assert ticket.handle is not None
        try:
            ticket.handle.wait()
        except Exception as err:
            self._fail(ticket, err)
        ticket.written = True
        if self.writer:
            ticket.hashing = self._helper_thread().submit(
                build_manifest,
                ticket.tmp_dir,
                step=ticket.step,
                config_hash=self._config_hash,
                sampler_state=ticket.sampler_state,
                serves_as_sync=ticket.serves_as_sync,
            )

    def _complete(self, ticket: SaveTicket) -> None:
        """Files hashed: write the manifest, install the directory, markers, retention."""
        if ticket.hashing is not None:
            try:
                manifest = ticket.hashing.result()
            except Exception as err:
                self._fail(ticket, err)
            del self._pending[ticket.step]
            self._install(ticket, manifest)
            self._after_install(ticket)
        else:
            del self._pending[ticket.step]
        ticket.finished = True

    def _helper_thread(self) -> ThreadPoolExecutor:
        """The one thread that hashes saves and runs retention, in the order submitted."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-helper")
        return self._helper

    def _check_retention(self, *, block: bool) -> None:
        """Raise the error of the last retention run once it is over (wait for it if `block`)."""
        if self._retention is not None and (block or self._retention.done()):
            run, self._retention = self._retention, None
            run.result()

    def _fail(self, ticket: SaveTicket, err: Exception) -> NoReturn:
        del self._pending[ticket.step]
        if self.writer:
            shutil.rmtree(ticket.tmp_dir, ignore_errors=True)
        raise CheckpointSaveError(
            f"saving checkpoint of step {ticket.step} into {ticket.tmp_dir} failed: {err}"
        ) from err

    def _install(self, ticket: SaveTicket, manifest: Manifest) -> None:
        """Manifest last, then rename the temp directory to `global_step_N/`."""
        write_manifest(ticket.tmp_dir, manifest)
        final = ticket.directory
        if final.exists():
            if self._satisfies(final, ticket):
                log.warning("keeping the complete checkpoint %s; discarding the new save", final)
                shutil.rmtree(ticket.tmp_dir)
                ticket.manifest = read_manifest(final)
                return
            log.warning("replacing checkpoint directory %s (incomplete or without HF)", final)
            discard_dir(final, ticket.step)
        os.rename(ticket.tmp_dir, final)
        fsync_dir(final.parent)
        fault_point("checkpoint_renamed", ticket.step)
        self._hashed.add(final)
        ticket.manifest = manifest
        log.info("checkpoint of step %d complete at %s", ticket.step, final)

    def _after_install(self, ticket: SaveTicket) -> None:
        """Markers forward (through the monitor), then retention on the helper thread.

        Retention is safe to run beside training and other processes (see `retention`); its
        error is raised by a later `poll()` or by `wait_all()`, which waits for it.
        """
        self.markers.notify_finished(ticket.step)
        if ticket.serves_as_sync:
            checkpoint_sync_dir(self.paths, ticket.step)
            self.markers.notify_finished(ticket.step, is_state_dict=True)
        self._check_retention(block=True)
        self._retention = self._helper_thread().submit(
            prune_checkpoints,
            self.paths,
            self.config.trainer.max_checkpoints_to_keep,
            in_progress=[t.tmp_dir for t in self._pending.values()],
            hashed=set(self._hashed),
            keep_step=sft_model_step(self.config),
        )

    # --- loading ---------------------------------------------------------------------
    def load(self, step: int | None = None) -> Manifest:
        """Verify checkpoint `step` (None: the newest complete one), load it into the provider.

        Returns its manifest (with the sampler state). A damaged checkpoint raises
        CorruptCheckpointError naming the file, and so does finding every checkpoint damaged
        (listing each one and why); no checkpoint at all raises FileNotFoundError.
        """
        self._check_retention(block=True)
        if step is None:
            found, rejected = _from_rank0(find_complete(self.paths, checksums=self.writer))
            if found is None:
                raise _no_complete_checkpoint(self.paths, rejected)
            directory = checkpoint_dir(self.paths, found[0])
            manifest = read_manifest(directory)
        else:
            directory = checkpoint_dir(self.paths, step)
            manifest = verify_checkpoint(directory, checksums=self.writer)
        if manifest.config_hash != self._config_hash:
            log.warning(
                "checkpoint %s was saved with config hash %s, this run has %s",
                directory,
                manifest.config_hash,
                self._config_hash,
            )
        self.provider.load_state(directory)
        if self.provider.step != manifest.step:
            raise CorruptCheckpointError(
                f"{directory}: the engine is at step {self.provider.step} after loading, "
                f"the manifest says step {manifest.step}"
            )
        log.info("loaded checkpoint of step %d from %s", manifest.step, directory)
        return manifest

    def resume(self) -> int | None:
        """Load the newest complete checkpoint, if any; return its step (None: fresh start)."""
        if _from_rank0(latest_complete(self.paths, checksums=False)) is None:
            return None
        return self.load().step
