"""The rendezvous store of the engine's weight sync and the two-rank groups transfers run in.

Engine rank 0 owns one `TCPStore` for the service's lifetime, listening on a socket it binds
itself (the control API's host: loopback unless `service.allow_non_loopback`), so nothing
listens on other interfaces. Each transfer gets a group of two ranks under a key prefix of
its own: rank 0 sends, rank 1 receives; gloo on CPU, NCCL on CUDA. The group is separate
from the engine's training group and lives for one transfer only.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]


def default_backend() -> Backend:
    """NCCL where CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def transfer_device(backend: Backend) -> torch.device:
    """Where a transfer's buffers must live for `backend`."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """A store listening on `host` at a free port (the socket's); keep the socket open."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        None,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    return store, sock


# Seconds a client tries to reach a store that should be listening. A store client retries
# a refused connection until its timeout (54 s for 20 s measured), so a store whose process
# died would hold a receiver for the whole transfer timeout.
CONNECT_TIMEOUT_S = 5.0


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at `host:port` whose calls time out after `timeout_s`.

    Raises `OSError` at once if the connection is refused (the store's process is gone),
    `dist.DistNetworkError` if it cannot connect within `CONNECT_TIMEOUT_S`."""
    socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    store = dist.TCPStore(
        host, port, None, False, timedelta(seconds=min(timeout_s, CONNECT_TIMEOUT_S))
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host:port` (loopback for a loopback host)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return str(probe.getsockname()[0])


def pair_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    backend: Backend,
    bind_host: str,
    timeout_s: float,
) -> Any:
    """The two-rank group (a c10d backend object with `broadcast`) of one transfer; blocks
    until both ranks joined, up to the timeout."""
    scoped = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, 2, options)
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(scoped, rank, 2, gloo_options)


@contextlib.contextmanager
def side_stream(backend: Backend) -> Iterator[None]:
    """Under NCCL, run the block's copies and collectives on a CUDA stream of their own (so
    the training stream never waits for a receiver) and wait for them at its end."""
    if backend != "nccl":
        yield
        return
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
