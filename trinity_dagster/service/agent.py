"""The engine service's torchrun agent, with its rendezvous store on loopback only.

torchrun's static rendezvous hosts a TCPStore on `--master_port`, and a TCPStore server
listens on every interface (no torchrun flag changes that: `--local-addr` and
`--rdzv-endpoint` only name the address others connect to). So this agent binds a socket
on 127.0.0.1 first and hosts the store on it (`master_listen_fd`); torchrun's own store on
that port is then the same server (`multi_tenant`), and nothing of the agent listens
beyond loopback. The ranks' gloo sockets bind loopback too (`GLOO_SOCKET_IFNAME=lo`, see
`engine/parallel.py`).

Usage: `python -m trinity_dagster.service.agent TORCHRUN_ARGS...`, single node, without
`--master_addr`/`--master_port` (this agent sets both).
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import run as torchrun

LOOPBACK = "127.0.0.1"


def loopback_store() -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, on a free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        timeout=timedelta(minutes=5),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with its rendezvous on a loopback-only store."""
    store = loopback_store()  # referenced until torchrun returns: its store shares the server
    rendezvous = [f"--master_addr={LOOPBACK}", f"--master_port={store.port}"]
    torchrun.main([*rendezvous, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
