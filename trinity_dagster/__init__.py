"""trinity-dagster: the trainer side of reinforcement fine-tuning as a Dagster asset graph.

Importing this package stays light: no torch, megatron or dagster at import time. It does
ask PyTorch and MKL for their portable x86 kernels (`cpu_numerics`) before either starts, so
that every process of a run (the CLI, Dagster's run workers, the engine service, tests)
computes alike on any x86-64 processor.
"""

import os

from trinity_dagster.cpu_numerics import use_portable_cpu_numerics

use_portable_cpu_numerics(os.environ)

__version__ = "0.1.0"
