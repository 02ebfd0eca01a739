"""Background saves of dist-checkpoint tensors: the writers, their results queue, save plans.

Background saves use dist_checkpointing's async save, so training may go on while the tensors
are written: from a snapshot taken and written by threads on CPU (`ThreadAsyncCaller`; the
engine waits for the snapshot before its next optimizer step), by Megatron's forked writer
process with CUDA (see `SaveQueue`).

What a save costs the caller is kept small: the save strategy (with its cached save plans) is
reused while the state's structure stays the same, and Megatron's sharding validation (a
gather of every shard's metadata) runs only when the structure is new — as Megatron-LM does
with `--ckpt-assume-constant-structure`, but checked instead of assumed. The writers' results
queue is made without Megatron's spawned manager process (see `ensure_write_results_queue`).

This module is the only one that relies on megatron-core internals: the module-level
`filesystem_async._results_queue` and the arguments of the write function that
`FileSystemWriterAsync` schedules. They are those of megatron-core 0.16, the versions
pyproject.toml allows; `tests/test_checkpoint_engine.py` covers them.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def ensure_write_results_queue(*, cross_process: bool) -> None:
    """Give dist_checkpointing's writers their results queue (Megatron's `_results_queue`).

    Megatron-core makes it on first use with a *spawn* `multiprocessing.Manager`: a fresh
    interpreter that re-imports the main module (torch, megatron), which held the first save
    of a process for 1-4 s. Writer threads and blocking saves put their results from this
    process, so an in-process queue serves them. A forked writer process needs a
    `cross_process` queue, served here by a forked manager (milliseconds, but its process
    shares the trainer's pages copy-on-write from then on).
    """
    current = getattr(filesystem_async, "_results_queue", None)
    if current is not None and not (cross_process and isinstance(current, queue.Queue)):
        return
    if current is not None and not current.empty():
        raise RuntimeError(
            "cannot switch dist_checkpointing's results queue to a forked writer while the "
            "results of a save are still unread: finalize pending saves first"
        )
    filesystem_async._results_queue = (
        mp.get_context("fork").Manager().Queue() if cross_process else queue.Queue()
    )


def _structure(value: Any) -> Any:
    """What decides a save plan: nested keys, shard keys, shapes, offsets, dtypes, replicas."""
    if isinstance(value, dict):
        return tuple((key, _structure(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return tuple(_structure(item) for item in value)
    if isinstance(value, ShardedBase):
        data = getattr(value, "data", None)
        local = (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None
        fields = (
            "key",
            "global_shape",
            "global_offset",
            "axis_fragmentations",
            "replica_id",
            "prepend_axis_num",
            "flattened_range",
        )
        return (type(value).__name__, local, *(repr(getattr(value, f, None)) for f in fields))
    return type(value).__name__


class SavePlanCache:
    """The save strategy of this process, reused while the state's structure stays the same.

    A new structure (or the first save) gets a fresh strategy and Megatron's sharding
    validation; later saves of the same structure reuse the strategy's cached save plans and
    skip the validation. Ranks agree on the decision (one all-reduce), since both are
    collective.
    """

    def __init__(self) -> None:
        self._strategy: TorchDistSaveShardedStrategy | None = None
        self._structure: Any = None

    def strategy_for(
        self, sharded_state_dict: dict[str, Any]
    ) -> tuple[TorchDistSaveShardedStrategy, bool]:
        """(strategy, whether to validate sharding) for saving `sharded_state_dict`."""
        structure = _structure(sharded_state_dict)
        changed = torch.tensor(
            [int(self._strategy is None or structure != self._structure)],
            device=torch.cuda.current_device(),  # the CPU layer maps it to CPU without CUDA
        )
        dist.all_reduce(changed)
        if int(changed.item()) == 0:
            assert self._strategy is not None
            return self._strategy, False
        self._strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
        self._structure = structure
        return self._strategy, True


_PLANS = SavePlanCache()  # one per process, like Megatron's parallel state


def _clone_buckets(buckets: list[Any]) -> list[Any]:
    """The writer's buckets with private copies of their tensors (a snapshot)."""
    return [
        (path, key, (byte_items, [(item, tensor.clone()) for item, tensor in tensor_items]))
        for path, key, (byte_items, tensor_items) in buckets
    ]


def _write_buckets(transforms: list[Any], buckets: list[Any], results: Any) -> None:
    """Write every bucket file (fsynced) in this thread; put {index: results} or an error."""
    results.put(_write_all(transforms, buckets))


def _write_all(transforms: list[Any], buckets: list[Any]) -> dict[int, Any] | Exception:
    """Write every bucket file (fsynced); {index: results}, or the first error."""
    local: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    write = FileSystemWriterAsync.write_preloaded_data
    written_by_index: dict[int, Any] = {}
    try:
        for index, bucket in enumerate(buckets):
            count.put(index)
            write(transforms, index, bucket, local, count, True)
            _, written = local.get()
            if isinstance(written, Exception):
                return written
            written_by_index[index] = written
    except Exception as err:
        return err
    return written_by_index


class ThreadAsyncCaller(AsyncCaller):
    """Runs dist_checkpointing's file writes on a writer thread of this process, from a snapshot.

    For a model in host memory (CPU training) this is cheaper for the train loop than
    Megatron's forked writer: after a fork, copy-on-write makes the next steps copy every page
    they touch (about 0.1 s per 100 MiB here), while the snapshot is one copy of the tensors to
    write. The snapshot is taken on the snapshot thread while training goes on; whoever changes
    the weights or optimizer state in place first waits for it (`SaveQueue.wait_for_snapshots`).
    Snapshots and writes each run one save at a time in order, so each save's results reach
    the shared results queue in the order they are finalized. Otherwise as
    `TemporalAsyncCaller`: every rank must agree that the write is done.
    """

    def __init__(self, snapshotter: ThreadPoolExecutor, writer: ThreadPoolExecutor) -> None:
        self._snapshotter = snapshotter
        self._writer = writer
        self.snapshot: Future[list[Any]] | None = None
        self._write: Future[None] | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Queue the snapshot of the tensors to write, then their write."""
        if async_req.async_fn is None:
            return
        write_fn = async_req.async_fn
        if not (
            isinstance(write_fn, partial)
            and write_fn.func is FileSystemWriterAsync.write_preloaded_data_multiproc
            and not write_fn.args[1]  # use_msc
        ):
            raise TypeError(f"ThreadAsyncCaller cannot run {write_fn!r}")
        _, buckets, results = async_req.async_fn_args
        snapshot = self._snapshotter.submit(_clone_buckets, buckets)
        self.snapshot = snapshot
        self._write = self._writer.submit(_write_snapshot, write_fn.args[0], snapshot, results)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the write finished on every rank (waits for it when `blocking`)."""
        is_alive = int(self._write is not None and not self._write.done())
        is_done = not is_alive if no_dist else self.sync_all_async_calls(is_alive)
        if is_done or blocking:
            self.close()
            is_done = True
        return is_done

    def close(self, abort: bool = False) -> None:
        """Wait for the write (it is never aborted: the snapshot is written or fails)."""
        if self._write is not None:
            self._write.result()
            self._write = None

    def __del__(self) -> None:  # AsyncCaller's raises NotImplementedError
        pass


def _write_snapshot(transforms: list[Any], snapshot: Future[list[Any]], results: Any) -> None:
    """`_write_buckets` of the snapshot once it is taken (its error, if taking it failed)."""
    try:
        buckets = snapshot.result()
    except Exception as err:
        results.put(err)
        return
    _write_buckets(transforms, buckets, results)


class _ThreadCallsQueue(AsyncCallsQueue):
    """`AsyncCallsQueue` whose calls run on a snapshot thread and a writer thread."""

    def __init__(self) -> None:
        super().__init__()
        self._snapshotter = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-snapshot")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._last_caller: ThreadAsyncCaller | None = None

    def _get_async_caller(self) -> AsyncCaller:
        self._last_caller = ThreadAsyncCaller(self._snapshotter, self._writer)
        return self._last_caller

    def wait_for_snapshots(self) -> None:
        """Block until every scheduled save has copied its tensors."""
        caller = self._last_caller
        if caller is not None and caller.snapshot is not None:
            caller.snapshot.exception()  # a failed snapshot is raised when the save finalizes

    def close(self, abort: bool = False) -> None:
        """Finalize every call, then stop the threads."""
        super().close(abort=abort)
        self._snapshotter.shutdown(wait=True)
        self._writer.shutdown(wait=True)


class SaveQueue:
    """Background saves in flight, over Megatron's `AsyncCallsQueue`; methods are collective.

    `writer` is `"fork"` (Megatron's forked writer process; the default with CUDA, where the
    tensors are staged from the device) or `"thread"` (a snapshot written by a thread of this
    process; the default on CPU). None picks the default.
    """

    def __init__(self, writer: str | None = None) -> None:
        writer = writer or ("fork" if torch.cuda.is_available() else "thread")
        if writer not in ("fork", "thread"):
            raise ValueError(f"SaveQueue writer must be 'fork' or 'thread', got {writer!r}")
        self.writer = writer
        self._calls = AsyncCallsQueue() if writer == "fork" else _ThreadCallsQueue()
        self._finalized: set[int] = set()

    def schedule(self, request: Any) -> int:
        """Start writing `request` in the background; its call index."""
        return self._calls.schedule_async_request(request)

    def wait_for_snapshots(self) -> None:
        """Block until the saves in flight no longer read the live tensors.

        Call it before changing weights or optimizer state in place. With the thread writer the
        tensors are copied in the background after `schedule` returns; the forked writer has
        its copy once `schedule` returns.
        """
        if isinstance(self._calls, _ThreadCallsQueue):
            self._calls.wait_for_snapshots()

    def finalize(self, *, blocking: bool) -> None:
        """Finalize the saves whose writers finished (all of them when `blocking`)."""
        self._finalized.update(self._calls.maybe_finalize_async_calls(blocking=blocking))

    def is_finalized(self, call_idx: int) -> bool:
        """Whether the save with index `call_idx` is complete."""
        return call_idx in self._finalized

    def close(self) -> None:
        """Wait for every pending save."""
        self.finalize(blocking=True)
        self._calls.close()


class EngineStateSave:
    """A state save, done or in progress; `done()` and `wait()` are collective (every rank)."""

    def __init__(self, queue: SaveQueue | None = None, call_idx: int = -1):
        self._queue = queue
        self._call_idx = call_idx

    def done(self) -> bool:
        """Whether the save is complete (finalizes it if its writer has finished)."""
        if self._queue is None:
            return True
        if not self._queue.is_finalized(self._call_idx):
            self._queue.finalize(blocking=False)
        return self._queue.is_finalized(self._call_idx)

    def wait(self) -> None:
        """Block until the save is complete; raises if writing failed on any rank."""
        if self._queue is not None and not self._queue.is_finalized(self._call_idx):
            self._queue.finalize(blocking=True)


def save_sharded(
    sharded_state_dict: dict[str, Any],
    directory: Path,
    *,
    queue: SaveQueue | None,
    finalize: Callable[[], None],
) -> EngineStateSave:
    """Write `sharded_state_dict` into `directory` with dist_checkpointing (collective).

    `finalize` runs on every rank once every rank's tensors are on disk: before this returns
    without a `queue`, when the save is finalized with one (the write goes on in the
    background).
    """
    ensure_write_results_queue(cross_process=queue is not None and queue.writer == "fork")
    strategy, validate = _PLANS.strategy_for(sharded_state_dict)
    request = dist_checkpointing.save(
        sharded_state_dict,
        str(directory),
        sharded_strategy=strategy,
        validate_access_integrity=validate,
        async_sharded_save=queue is not None,
    )
    if queue is None:
        finalize()
        return EngineStateSave()
    request.finalize_fns.append(finalize)
    return EngineStateSave(queue, queue.schedule(request))
