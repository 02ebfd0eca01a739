"""The engine service's torchrun agent, with its stores on loopback only when it stays local.

torchrun's static rendezvous hosts a TCPStore on `--master_port`, and a TCPStore server
listens on every interface (no torchrun flag changes that: `--local-addr` and
`--rdzv-endpoint` only name the address others connect to). So on one node this agent binds
a socket on 127.0.0.1 first and hosts the store on it (`master_listen_fd`); torchrun's own
store on that port is then the same server (`multi_tenant`), and nothing of the agent
listens beyond loopback. The ranks' gloo sockets bind loopback too (`GLOO_SOCKET_IFNAME=lo`,
see `engine/parallel.py`).

On N nodes (`--rdzv-backend=c10d`) the agents meet at `--rdzv-endpoint`; the node with
`--rdzv-conf=is_host=true` hosts the store there (`false`: it only connects; absent: the
node that can host it does), and the agent that the rendezvous makes group rank 0 hosts a
second store for its ranks. With a loopback endpoint (every node on this machine, as in the
tests) both stores listen on the loopback address only, the same way; with another endpoint
(`service.allow_non_loopback`) torchrun hosts them as it always does.

Usage: `python -m trinity_dagster.service.agent TORCHRUN_ARGS...`: one node without
`--master_addr`/`--master_port` (this agent sets both), or N nodes with c10d.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from unittest.mock import patch

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)

from trinity_dagster.config import is_loopback_host

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = timedelta(minutes=5)


class RendezvousHostError(RuntimeError):
    """This node was told to host the rendezvous store and cannot bind its endpoint."""


def hosted_store(host: str, port: int) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=64)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        timeout=STORE_TIMEOUT,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )


def _single_node(argv: list[str]) -> None:
    """torchrun with its static rendezvous on a store on 127.0.0.1."""
    store = hosted_store(LOOPBACK, 0)  # referenced until torchrun returns: shared server
    torchrun.main([f"--master_addr={LOOPBACK}", f"--master_port={store.port}", *argv])


def _wants_to_host(rdzv_conf: str) -> bool | None:
    """The `is_host` of a `--rdzv-conf` value (None: not given)."""
    params = RendezvousParameters("c10d", "", "", 1, 1, **_parse_rendezvous_config(rdzv_conf))
    return params.get_as_bool("is_host")


def _host_rendezvous(host: str, port: int, is_host: bool | None) -> dist.TCPStore | None:
    """The rendezvous store on `host:port` if this node hosts it, else None."""
    if is_host is False:
        return None
    try:
        return hosted_store(host, port)
    except OSError as err:
        if is_host:
            raise RendezvousHostError(
                f"this node hosts the rendezvous (node rank 0, is_host=true) but cannot "
                f"listen on {host}:{port} (service.rdzv_endpoint): {err}"
            ) from err
        return None  # another node on this machine hosts it: torchrun connects to it


def _loopback_nodes(argv: list[str], host: str, port: int, is_host: bool | None) -> None:
    """torchrun with c10d, its rendezvous and rank stores on the loopback address `host`."""
    _store = _host_rendezvous(host, port, is_host)  # referenced until torchrun returns
    # torchrun offers no option for the address its rank store listens on
    with patch.object(DynamicRendezvousHandler, "_create_tcp_store_server", _ranks_store):
        torchrun.main([f"--local-addr={host}", *argv])


def _ranks_store(_handler: DynamicRendezvousHandler, addr: str, port: int) -> dist.TCPStore:
    """The store group rank 0's agent hosts for its ranks: on its (loopback) local address,
    not on every interface."""
    return hosted_store(addr, port)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun, keeping every store on loopback unless the endpoint is elsewhere."""
    args = sys.argv[1:] if argv is None else argv
    options = torchrun.get_args_parser().parse_args(args)
    if options.rdzv_backend == "static":
        if options.nnodes != "1":
            raise SystemExit(
                f"agent: --nnodes={options.nnodes} needs --rdzv-backend=c10d and --rdzv-endpoint"
            )
        _single_node(args)
        return
    host, port = parse_rendezvous_endpoint(options.rdzv_endpoint, default_port=29400)
    if not is_loopback_host(host):
        torchrun.main(args)
        return
    if options.local_addr is not None and not is_loopback_host(options.local_addr):
        raise SystemExit(
            f"agent: --local-addr={options.local_addr} is not loopback but the rendezvous "
            f"endpoint {host}:{port} is: every node of this service runs on this machine"
        )
    _loopback_nodes(args, host, port, _wants_to_host(options.rdzv_conf))


if __name__ == "__main__":
    main()
