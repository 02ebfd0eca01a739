"""Scripts the engine tests run in fresh processes (Megatron's parallel state is global)."""
