"""The same CPU arithmetic on every x86-64 machine: PyTorch's and MKL's AVX2 code paths.

PyTorch and MKL choose their kernels by the processor (AVX2, AVX-512, ...), and those
kernels round differently, so a training on CPU ends with other weights on another
processor from the same seed. The demo's GRPO samples at temperature 1 and amplifies such
last-bit differences: with the same seed and code, held-out accuracy ended at 0.20 with the
AVX-512 kernels of one machine and at 0.38 with the AVX2 kernels. Importing `trinity_dagster`
therefore asks for the AVX2 paths, in every process of a run (the CLI, Dagster's run workers,
the engine service) and before torch or MKL starts, and child processes inherit it. On
Intel processors a seed then gives the same run on every model (MKL guarantees it for its
routines under `MKL_CBWR`). MKL ignores `MKL_CBWR=AVX2` on AMD processors and chooses its own
kernels there; only `MKL_CBWR=COMPATIBLE` (SSE2, ~40% slower on the demo) is honoured on
both vendors, so it is the user's choice, not the default. A value already in the
environment wins; other architectures are left alone. A program that starts torch before it
imports `trinity_dagster` keeps the kernels torch chose.
"""

from __future__ import annotations

import platform
from collections.abc import MutableMapping

PORTABLE_X86 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def use_portable_cpu_numerics(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the portable kernel choice in `environ` where unset; returns what was set."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    added = {name: value for name, value in PORTABLE_X86.items() if name not in environ}
    environ.update(added)
    return added
