"""Engine rank 0's side of collective weight sync: the versions it holds and the transfers.

`stage(N, tensors)` packs weights version N (tensors under 1 MiB are copied into buckets,
larger ones stay where they are; every bucket is checksummed) and holds it: the newest
`KEEP` versions. An explorer that wants version N asks for a transfer (`open_transfer`,
behind the control API's `/weights/transfer`): it gets the layout and the group to join,
and a thread of this process broadcasts the buckets to it in a two-rank group, then waits
for the receiver's verdict. The training loop never waits for explorers: a receiver that
never joins, dies mid-broadcast or reports a checksum mismatch fails its own transfer only,
after at most the group's timeout (`synchronizer.sync_timeout`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from trinity_dagster.weight_sync.buckets import Layout, pack
from trinity_dagster.weight_sync.group import (
    Backend,
    default_backend,
    join_store,
    pair_group,
    serve_store,
    side_stream,
    transfer_device,
)

KEEP = 2
HISTORY = 32
RESULT_KEY = "result"
OK = "ok"

log = logging.getLogger(__name__)


class VersionNotHeldError(LookupError):
    """An explorer asked for a weights version this sender does not hold (the message says
    which it holds)."""


@dataclass(frozen=True)
class StagedVersion:
    """One weights version packed for transfers."""

    version: int
    layout: Layout
    buffers: list[torch.Tensor]


class WeightSender:
    """Holds staged weights versions and serves transfers of them, each in its own thread."""

    def __init__(
        self,
        bind_host: str,
        advertised_host: str,
        timeout_s: float,
        backend: Backend | None = None,
    ) -> None:
        self.bind_host = bind_host
        self.address = advertised_host
        self.timeout_s = timeout_s
        self.backend: Backend = backend or default_backend()
        self.store, self._socket = serve_store(bind_host, timeout_s)
        self.port = int(self._socket.getsockname()[1])
        self._lock = threading.Lock()
        self._staged: dict[int, StagedVersion] = {}
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._corrupt_bucket: int | None = None
        self.transfers: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> Layout:
        """Hold weights `version` (HF-named CPU tensors nothing else changes) for transfers."""
        layout, buffers = pack(tensors)
        with self._lock:
            self._staged[version] = StagedVersion(version, layout, buffers)
            for old in sorted(self._staged)[:-KEEP]:
                del self._staged[old]  # a transfer in flight keeps its own reference
        return layout

    def layout_bytes(self, version: int) -> int:
        """Bytes a transfer of held `version` moves."""
        with self._lock:
            return self._staged[version].layout.nbytes

    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        with self._lock:
            return sorted(self._staged)

    def open_transfer(self, version: int, receiver: str) -> dict[str, Any]:
        """Start sending `version` to `receiver`; returns what the receiver needs to join."""
        with self._lock:
            staged = self._staged.get(version)
            corrupt, self._corrupt_bucket = self._corrupt_bucket, None
        if staged is None:
            raise VersionNotHeldError(
                f"weights version {version} is not held for collective sync (held: "
                f"{', '.join(map(str, self.versions())) or 'none'})"
            )
        transfer = next(self._ids)
        prefix = f"transfer/{transfer}/"
        thread = threading.Thread(
            target=self._send,
            args=(staged, prefix, receiver, corrupt),
            name=f"weight-transfer-{transfer}",
            daemon=True,
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return {
            "transfer": transfer,
            "version": version,
            "backend": self.backend,
            "address": self.address,
            "port": self.port,
            "prefix": prefix,
            "timeout_s": self.timeout_s,
            "layout": staged.layout.to_json(),
        }

    def corrupt_next_transfer(self, bucket: int = 0) -> None:
        """Test hook: damage one byte of `bucket` in flight in the next transfer (the held
        copy stays whole), so that the receiver's check can be seen to catch it."""
        with self._lock:
            self._corrupt_bucket = bucket

    def status(self) -> dict[str, Any]:
        """Address, held versions and the latest transfers (for the engine's status)."""
        return {
            "address": self.address,
            "port": self.port,
            "backend": self.backend,
            "versions": self.versions(),
            "transfers": list(self.transfers)[-5:],
        }

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting receivers; transfers in flight get `wait_s` to end."""
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._socket.close()

    @staticmethod
    def _receivers_verdict(store: torch.distributed.Store, prefix: str) -> str | None:
        """What a receiver that gave up reported (a damaged bucket, a model mismatch), if it did."""
        key = prefix + RESULT_KEY
        try:
            return store.get(key).decode(errors="replace") if store.check([key]) else None
        except Exception:  # the store itself failed: the transfer's own error stands
            return None

    def _send(self, staged: StagedVersion, prefix: str, receiver: str, corrupt: int | None) -> None:
        started = time.perf_counter()
        record: dict[str, Any] = {"receiver": receiver, "version": staged.version, "ok": False}
        store = None
        try:
            # a client of its own: a store client serves one blocking call at a time, and
            # another transfer's wait for a receiver that never comes must not hold this one
            store = join_store(self.bind_host, self.port, self.timeout_s)
            group = pair_group(store, prefix, 0, self.backend, self.bind_host, self.timeout_s)
            device = transfer_device(self.backend)
            with side_stream(self.backend):
                for index, buffer in enumerate(staged.buffers):
                    outgoing = buffer.to(device)
                    if index == corrupt:
                        outgoing = outgoing.clone()
                        outgoing[0] ^= 0x5A
                    group.broadcast(outgoing, 0).wait()
            verdict = store.get(prefix + RESULT_KEY).decode(errors="replace")
            if verdict != OK:
                raise RuntimeError(verdict)
            record["ok"] = True
        except Exception as err:  # one receiver's failure; training and others go on
            told = None if store is None else self._receivers_verdict(store, prefix)
            record["error"] = told or f"{type(err).__name__}: {err}"
            log.warning(
                "weights version %d to %s failed: %s", staged.version, receiver, record["error"]
            )
        finally:
            record["seconds"] = time.perf_counter() - started
            record["bytes"] = staged.layout.nbytes
            self.transfers.append(record)
