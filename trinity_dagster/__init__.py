"""trinity-dagster: the trainer side of reinforcement fine-tuning as a Dagster asset graph.

Importing this package stays light: no torch, megatron or dagster at import time.
"""

__version__ = "0.1.0"
