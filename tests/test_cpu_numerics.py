"""Importing trinity_dagster pins PyTorch's and MKL's kernel choice on x86-64, so that every
process of a run computes alike, on any processor."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from trinity_dagster import cpu_numerics
from trinity_dagster.cpu_numerics import PORTABLE_X86, use_portable_cpu_numerics


def test_the_portable_kernels_are_asked_for_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_numerics.platform, "machine", lambda: "x86_64")
    environ = {"MKL_CBWR": "COMPATIBLE"}  # the user's choice wins
    assert use_portable_cpu_numerics(environ) == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert environ == {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}


def test_other_architectures_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_numerics.platform, "machine", lambda: "aarch64")
    environ: dict[str, str] = {}
    assert use_portable_cpu_numerics(environ) == {} and environ == {}


@pytest.mark.skipif(platform.machine().lower() != "x86_64", reason="x86-64 kernels")
def test_torch_takes_the_avx2_kernels_when_asked() -> None:
    environ = {k: v for k, v in os.environ.items() if k not in PORTABLE_X86}
    use_portable_cpu_numerics(environ)
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "AVX2", done.stdout + done.stderr


@pytest.mark.skipif(platform.machine().lower() != "x86_64", reason="x86-64 kernels")
def test_every_process_that_imports_the_package_takes_them() -> None:
    environ = {k: v for k, v in os.environ.items() if k not in PORTABLE_X86}
    probe = "import trinity_dagster, torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "AVX2", done.stdout + done.stderr
