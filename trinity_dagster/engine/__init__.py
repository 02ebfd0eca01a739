"""The Megatron-core training engine: CPU layer, process groups, model, HF import/export.

Submodules import torch and megatron; import them directly (`trinity_dagster.engine.model`),
never from the Dagster code location.
"""
