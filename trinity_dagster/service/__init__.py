"""The engine service: torchrun workers behind a control API, its launcher and its client."""
