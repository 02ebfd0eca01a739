"""Which weights versions the held-out evaluation scores once training ended.

Imports neither torch nor transformers, so sensors and the run's watcher can use it.
"""

from __future__ import annotations

from trinity_dagster.checkpoint.layout import weights_dir
from trinity_dagster.checkpoint.rules import sft_model_step
from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths


def versions_to_evaluate(config: TrinityConfig, paths: RunPaths, final_version: int) -> list[int]:
    """The weights versions scored once training ended: the initial weights (0), the SFT
    warm-up's last weights when RL steps followed it and they are on disk (the trainer
    checkpoints that step), and the final weights `final_version`."""
    versions = {0, final_version}
    sft = sft_model_step(config)
    if sft is not None and sft < final_version:
        try:
            weights_dir(paths, sft)
        except FileNotFoundError:
            pass  # not exported (`save_hf_checkpoint: never`) or deleted by hand
        else:
            versions.add(sft)
    return sorted(versions)
