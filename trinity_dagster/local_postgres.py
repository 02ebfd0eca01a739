"""A throwaway PostgreSQL server in a directory of its own, for tests and benchmarks.

It runs the machine's `initdb`/`pg_ctl`/`postgres` (Debian's `postgresql` package), listens
on a Unix socket in its directory only (no TCP port), trusts local connections and is
stopped and deleted at the end. PostgreSQL refuses to run as root, so as root the server runs
as `nobody`. A real deployment points `dagster.postgres_url` at its own server instead
(docs/scaling.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PORT = 5432  # only names the socket file; no TCP listener
USER = "dagster"
SEARCH = ("/usr/lib/postgresql",)


class PostgresUnavailableError(RuntimeError):
    """The PostgreSQL server programs are not installed, or the server did not start."""


@dataclass(frozen=True)
class LocalPostgres:
    """A running local server: its socket directory and the URL of one of its databases."""

    socket_dir: Path

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of `database` on this server (over its Unix socket)."""
        return f"postgresql://{USER}@/{database}?host={self.socket_dir}&port={PORT}"

    def create_database(self, name: str) -> str:
        """Create database `name`; returns its URL."""
        self._psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def database_size(self, name: str) -> int:
        """Bytes the database `name` takes on disk."""
        out = self._psql(f"SELECT pg_database_size('{name}')")
        return int(out.strip())

    def _psql(self, sql: str) -> str:
        done = subprocess.run(
            [
                _program("psql"),
                "-h",
                str(self.socket_dir),
                "-p",
                str(PORT),
                "-U",
                USER,
                "-d",
                "postgres",
                "-tAc",
                sql,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise PostgresUnavailableError(f"psql {sql!r} failed: {done.stderr.strip()}")
        return done.stdout


def _program(name: str) -> str:
    """The path of PostgreSQL program `name` (on PATH, or in Debian's versioned bin dir)."""
    found = shutil.which(name)
    if found:
        return found
    for base in SEARCH:
        for candidate in sorted(Path(base).glob(f"*/bin/{name}"), reverse=True):
            return str(candidate)
    raise PostgresUnavailableError(
        f"PostgreSQL's {name} is not installed (Debian: apt install postgresql)"
    )


def _as_server_user(command: list[str]) -> list[str]:
    """`command` run as `nobody` when this process is root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return command
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]


@contextmanager
def local_postgres() -> Iterator[LocalPostgres]:
    """Start a server in a new directory; stop it and delete it at the end.

    The directory is made in the system's temporary directory: the server's user must be
    able to reach it, and a Unix socket's path is limited to about 100 characters.
    """
    home = Path(tempfile.mkdtemp(prefix="pg-"))
    if os.geteuid() == 0:
        shutil.chown(home, user="nobody", group="nogroup")
    data = home / "data"
    env = {**os.environ, "LC_ALL": "C"}

    def run(command: list[str], what: str) -> None:
        done = subprocess.run(_as_server_user(command), capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise PostgresUnavailableError(f"{what} failed: {(done.stderr or done.stdout)[-2000:]}")

    try:
        run([_program("initdb"), "-D", str(data), "-A", "trust", "-U", USER], "initdb")
        options = f"-k {home} -c listen_addresses='' -p {PORT}"
        log = str(home / "log")
        run([_program("pg_ctl"), "-D", str(data), "-o", options, "-l", log, "-w", "start"], "start")
        try:
            yield LocalPostgres(home)
        finally:
            run([_program("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], "pg_ctl stop")
    finally:
        shutil.rmtree(home, ignore_errors=True)
