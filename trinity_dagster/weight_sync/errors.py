"""The error of a failed collective weight transfer, importable without torch."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A collective transfer failed or delivered weights that do not check out."""
