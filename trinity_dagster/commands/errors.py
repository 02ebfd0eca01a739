"""The errors a command ends with: one line for the user, no traceback (`trinity_dagster.cli`).

Kept apart from the commands so that the `trinity-dagster` entry point imports nothing heavy.
"""

from __future__ import annotations

import signal


class TrainingRunError(RuntimeError):
    """A run of the graph failed for good, or the daemon stopped; the message says which."""


class StoppedBySignal(Exception):
    """SIGINT or SIGTERM stopped the command; what it started is stopped once this reaches
    the caller."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name}: daemon, runs and engine stopped"
        )

    @property
    def exit_code(self) -> int:
        """The status of a process that the signal ended (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum
