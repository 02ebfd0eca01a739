"""Entry point of one engine service rank, launched by torchrun or alone (see `launcher.py`).

Every rank builds its engine host; rank 0 also serves the control API and publishes the
service state file once it answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from trinity_dagster.config import TrinityConfig, load_config
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.owner import current_owner, orphaned
from trinity_dagster.service.server import (
    CommandBus,
    ControlServer,
    bind_socket,
    build_app,
    check_bind_host,
    rank0_loop,
    worker_loop,
)
from trinity_dagster.service_api.state import (
    ServiceState,
    advertised_host,
    clear_state,
    read_token,
    write_state,
)
from trinity_dagster.torch_threads import engine_torch_threads

log = logging.getLogger("trinity_dagster.service")

# Optional imports of megatron-core that a rank never uses (its tracking is the trainer's):
# refused here, they spare each rank about 20 MB and a part of a second of start.
UNUSED_BY_RANKS = ("wandb", "torch.utils.tensorboard")


def refuse_unused_imports() -> None:
    """Make the `UNUSED_BY_RANKS` modules fail to import in this process (megatron-core
    imports them only if it can)."""
    for name in UNUSED_BY_RANKS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Run this rank of the service until shutdown or idle timeout."""
    parser = argparse.ArgumentParser(description="trinity-dagster engine service rank")
    parser.add_argument("-c", "--config", required=True)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    paths = RunPaths.of_config(config)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=config.monitor.log_level,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    if rank == 0:
        check_bind_host(config.service.host, config.service.allow_non_loopback)
    refuse_unused_imports()
    # torch and megatron-core, only now
    import torch

    from trinity_dagster.engine.megatron_import import import_megatron_core_without_jit_fuser

    import_megatron_core_without_jit_fuser()
    from trinity_dagster.engine.parallel import launched_by_agent
    from trinity_dagster.service.host import EngineHost

    owner = current_owner(paths) if rank == 0 else None  # only rank 0 watches it
    if owner is not None:
        log.info(
            "owned by process %d: once its owner exits, idle for at most %.0f s",
            owner.pid,
            config.service.orphan_timeout_s,
        )
    threads = engine_torch_threads(config, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    log.info("%d torch thread(s) (trainer.torch_threads)", threads)
    host = EngineHost(config, paths)
    try:
        if rank != 0:
            worker_loop(host)
            return 0
        bus = CommandBus()
        sock = bind_socket(config.service.host, config.service.port)
        sender = host.weight_sender
        app = build_app(
            bus,
            read_token(paths),
            host.status,
            config.service.request_timeout_s,
            transfers=None if sender is None else sender.open_transfer,
        )
        server = ControlServer(app, sock)
        server.start()
        signal.signal(signal.SIGTERM, lambda *_: bus.request_shutdown())
        state = ServiceState(
            pid=os.getpid(),
            pgid=os.getpgid(0),
            # torchrun's agent, or this process when started alone (`launcher.runs_alone`)
            launcher_pid=os.getppid() if launched_by_agent() else os.getpid(),
            host=advertised_host(config.service.host),
            port=server.port,
            world_size=host.world_size,
            config_hash=config.resolved_hash(),
            log_file=str(paths.engine_log),
            weight_sync_port=None if sender is None else sender.port,
        )
        write_state(paths, state)
        log.info("engine service ready at %s (step %d)", state.url, host.engine.step)
        try:
            reason = rank0_loop(
                host,
                bus,
                config.service.idle_timeout_s,
                orphan_timeout_s=config.service.orphan_timeout_s,
                orphaned=lambda: orphaned(paths),
            )
            log.info("engine service stopping: %s", _why(reason, paths, config))
        finally:
            clear_state(paths, os.getpid())
            server.stop()
        return 0
    finally:
        host.close()


def _why(reason: str, paths: RunPaths, config: TrinityConfig) -> str:
    """The log's words for why the service stops."""
    if reason == "idle":
        return f"idle for {config.service.idle_timeout_s:.0f} s (service.idle_timeout_s)"
    owner = current_owner(paths)
    if reason == "orphaned" and owner is not None:
        return (
            f"its owner, process {owner.pid}, exited, and no command came for "
            f"{config.service.orphan_timeout_s:.0f} s (service.orphan_timeout_s)"
        )
    return reason


if __name__ == "__main__":
    sys.exit(main())
