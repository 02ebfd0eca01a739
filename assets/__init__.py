"""The Dagster code location: assets, checks, sensors, schedules and jobs of the RFT graph.

Loaded from the repo root by `workspace.yaml`; never imports torch or megatron.
"""
