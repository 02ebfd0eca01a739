"""Dagster resources of the code location (loaded from the repo root, not installed)."""
