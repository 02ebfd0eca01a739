"""Where everything of a run lives under its run root, and where its Delta tables live.

The Delta tables (experiences, batches, quarantine, ledger/*) are named by a *location*: a
local path or a URI (`file:///abs/dir`). Delta Lake opens either as given; code that needs the
local file system (creating a directory, a `stat` of the log) asks `local_path` for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from urllib.request import url2pathname

if TYPE_CHECKING:
    from trinity_dagster.config import TrinityConfig

LOCAL_URI_SCHEMES = ("file",)
SHM_ROOT = Path("/dev/shm")  # where `sync_method: memory` keeps its weights regions
# What Delta Lake (deltalake 1.6) cannot address in a table's real path (measured): `^ | [ ]`
# make a write panic, `\` is taken as a separator, control characters are refused, and `%`
# with two hex digits is decoded twice, so a table under `a%20b` is read and written under
# `a b`.
DELTA_UNADDRESSABLE = re.compile(r"[\^|\[\]\\\x00-\x1f\x7f]|%[0-9A-Fa-f]{2}")


def delta_unaddressable(location: str | Path) -> list[str]:
    """The characters of `location`'s real local path that Delta Lake cannot address."""
    real = local_path(location).resolve()  # Delta Lake resolves symbolic links too
    return sorted(set(DELTA_UNADDRESSABLE.findall(str(real))))


def uri_scheme(location: str) -> str | None:
    """The URI scheme of `location` (`"file"` for `file:///x`), or None for a plain path."""
    scheme = urlsplit(location).scheme
    return scheme.lower() if len(scheme) > 1 and "://" in location else None


def local_path(location: str | Path) -> Path:
    """The local file system path of a table location: a plain path or a `file://` URI.

    Raises ValueError for a URI of another scheme or a `file://` URI naming another host.
    """
    if isinstance(location, Path):
        return location
    scheme = uri_scheme(location)
    if scheme is None:
        return Path(location)
    parts = urlsplit(location)
    if scheme not in LOCAL_URI_SCHEMES or parts.netloc not in ("", "localhost"):
        raise ValueError(f"{location!r} is not on the local file system (a path or file:///...)")
    return Path(url2pathname(parts.path))


def join_location(base: str | Path, name: str) -> str:
    """The location `name` inside the location `base` (a path or a URI)."""
    if isinstance(base, str) and uri_scheme(base) is not None:
        return f"{base.rstrip('/')}/{name}"
    return str(Path(base) / name)


@dataclass(frozen=True)
class RunPaths:
    """The fixed layout of a run root directory, with the location of its Delta tables.

    `tables_root` is where `experiences/`, `batches/`, `quarantine/` and `ledger/` live: a
    directory or a `file://` URI (config `buffer.tables_root`); None puts them under the run
    root.
    """

    root: Path
    tables_root: str | None = None

    @classmethod
    def of(cls, run_root: str | Path, tables_root: str | None = None) -> RunPaths:
        """The layout for `run_root`, with the Delta tables under `tables_root` if given."""
        return cls(Path(run_root), tables_root)

    @classmethod
    def of_config(cls, config: TrinityConfig) -> RunPaths:
        """The layout of a configured run: its run root and `buffer.tables_root`."""
        return cls.of(config.run_root, config.buffer.tables_root)

    def table(self, name: str) -> str:
        """The location of the Delta table `name` (a path, or a URI under a URI root)."""
        return join_location(self.root if self.tables_root is None else self.tables_root, name)

    @property
    def dagster_home(self) -> Path:
        """The Dagster instance (SQLite storage) of this run."""
        return self.root / "dagster_home"

    @property
    def experiences(self) -> str:
        """Location of the Delta table that explorers append experiences to."""
        return self.table("experiences")

    @property
    def batches(self) -> str:
        """Location of the Delta table of the experiences pinned to each train step."""
        return self.table("batches")

    @property
    def quarantine(self) -> str:
        """Location of the Delta table of rejected experiences with the reason."""
        return self.table("quarantine")

    @property
    def ledger_steps(self) -> str:
        """Location of the lineage ledger's table of what each step consumed (one row per
        pinned experience)."""
        return self.table("ledger/steps")

    @property
    def ledger_rollouts(self) -> str:
        """Location of the lineage ledger's table of the experiences commits: which explorer,
        explore step and weights version wrote them."""
        return self.table("ledger/rollouts")

    @property
    def checkpoints(self) -> Path:
        """Full checkpoints: `global_step_N/` and the `latest_*.txt` markers."""
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        """Weights published to explorers (HF format), one directory per version."""
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        """Service logs and metrics files."""
        return self.root / "logs"

    @property
    def service(self) -> Path:
        """Engine service state: token, pid and port files."""
        return self.root / "service"

    @property
    def control(self) -> Path:
        """Requests from Dagster runs to the trainer loop and their answers; the pause mark."""
        return self.root / "control"

    @property
    def tokenizer(self) -> Path:
        """The tokenizer (HF format) shared by the model, explorers and exports."""
        return self.root / "tokenizer"

    # --- files and directories in the run root --------------------------------------------
    @property
    def config_file(self) -> Path:
        """The resolved config `trinity-dagster run` wrote for the code location."""
        return self.root / "config.yaml"

    @property
    def summary_file(self) -> Path:
        """`trinity-dagster run`'s summary of a finished training."""
        return self.root / "summary.json"

    @property
    def end_of_data(self) -> Path:
        """One mark per explorer that will write no more experiences."""
        return self.root / "_end_of_data"

    @property
    def initial_weights_lock(self) -> Path:
        """The lock under which processes that start together create weights version 0."""
        return self.root / ".initial_model.lock"

    # --- under logs/ ------------------------------------------------------------------------
    @property
    def trainer_state_file(self) -> Path:
        """The trainer loop's state: running, paused, finished or failed, and why."""
        return self.logs / "trainer_state.json"

    @property
    def heartbeats(self) -> Path:
        """One heartbeat file per explorer loop."""
        return self.logs / "heartbeats"

    @property
    def wakeup(self) -> Path:
        """The sockets of loops waiting for experiences or weights (`handoff.wakeup`)."""
        return self.logs / "wakeup"

    @property
    def step_records(self) -> Path:
        """The engine's record of each trained step."""
        return self.logs / "steps"

    @property
    def checkpoint_lineage(self) -> Path:
        """The lineage of each checkpoint, summed up when it was saved."""
        return self.logs / "checkpoint_lineage"

    @property
    def engine_log(self) -> Path:
        """The engine service's log."""
        return self.logs / "engine.log"

    @property
    def daemon_log(self) -> Path:
        """`dagster-daemon run`'s log under `trinity-dagster run`."""
        return self.logs / "dagster-daemon.log"

    @property
    def code_server_log(self) -> Path:
        """The log of the Dagster code servers that `trinity-dagster run` starts."""
        return self.logs / "code-server.log"

    @property
    def metrics_jsonl(self) -> Path:
        """The `jsonl` tracking backend's metrics, one line per step."""
        return self.logs / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        """The `tensorboard` tracking backend's event files."""
        return self.logs / "tensorboard"

    @property
    def mlflow(self) -> Path:
        """The `mlflow` tracking backend's local store."""
        return self.logs / "mlflow"

    # --- under weights/ ---------------------------------------------------------------------
    @property
    def sync_requests(self) -> Path:
        """Explorers' requests for newer weights (`sync_style: explorer_driven`)."""
        return self.weights / "requests"

    @property
    def weights_holds(self) -> Path:
        """Holds that keep weights versions from pruning while a reader loads them."""
        return self.weights / "holds"

    @property
    def weights_shared(self) -> Path:
        """The files that published versions repeat, stored once by content and hard-linked."""
        return self.weights / "shared"

    # --- under service/ ---------------------------------------------------------------------
    @property
    def service_state_file(self) -> Path:
        """Where the running engine service listens, its pid and its config's hash."""
        return self.service / "state.json"

    @property
    def service_token(self) -> Path:
        """The engine service's access token (owner-only)."""
        return self.service / "token"

    @property
    def service_config(self) -> Path:
        """The config the engine service was started with."""
        return self.service / "config.yaml"

    @property
    def service_owner(self) -> Path:
        """The process whose Dagster deployment the engine service belongs to."""
        return self.service / "owner.json"

    @property
    def service_start_lock(self) -> Path:
        """The lock under which one client starts the engine service."""
        return self.service / "start.lock"

    @property
    def weights_announcement(self) -> Path:
        """The newest weights version the service holds for collective transfers."""
        return self.service / "collective_weights.json"

    @property
    def fault_fired(self) -> Path:
        """The record of an injected fault that fired (tests)."""
        return self.service / "fault_fired.json"

    # --- under control/ ---------------------------------------------------------------------
    @property
    def control_requests(self) -> Path:
        """Control requests of Dagster runs to the trainer loop."""
        return self.control / "requests"

    @property
    def control_answers(self) -> Path:
        """The trainer loop's answers to control requests."""
        return self.control / "answers"

    @property
    def pause_mark(self) -> Path:
        """Present while the user has paused training."""
        return self.control / "paused.json"
