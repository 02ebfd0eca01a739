"""`python -m trinity_dagster.commands.daemon_main SOCKET... -- ARG...`: `dagster-daemon ARG...`
once every code server socket given accepts connections.

`trinity-dagster run` starts the code servers and the daemon together: the daemon's imports
and its instance (about 2 CPU-seconds) come up while the servers load the code location,
and the daemon loads its workspace only once they serve (a location unreachable at the
daemon's first load stays in error until Dagster's next recovery check, about 10 s on).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trinity_dagster.commands.code_server import POLL_S, STARTUP_TIMEOUT_S, serving


def main(argv: list[str]) -> int:
    """Wait for the sockets before `--`, then run `dagster-daemon` with the arguments after."""
    split = argv.index("--")
    sockets, daemon_args = [Path(arg) for arg in argv[:split]], argv[split + 1 :]
    from dagster._core.instance import DagsterInstance
    from dagster._daemon.cli import main as dagster_daemon

    DagsterInstance.get().dispose()  # its storages' imports, beside the servers' start
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not all(serving(sock) for sock in sockets):
        if time.monotonic() > deadline:
            print(f"no code server on {sockets} after {STARTUP_TIMEOUT_S:.0f} s", flush=True)
            return 1
        time.sleep(POLL_S)
    sys.argv = ["dagster-daemon", *daemon_args]
    dagster_daemon()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
