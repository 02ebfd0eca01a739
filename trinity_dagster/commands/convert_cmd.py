"""`trinity-dagster convert --checkpoint DIR --out DIR [--critic]`: a full checkpoint to an HF
directory.

For checkpoints saved with `save_hf_checkpoint: never` (or any other). The checkpoint is
verified against its manifest first; its `model/` holds the HF config and tokenizer, and
dist_checkpointing reshards whatever parallel layout it was saved with onto one rank.
`--critic` writes PPO's value model instead, as an HF token-classification model with one
label (its config is in `critic_model/`).
"""

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `convert`."""
    parser.add_argument("--checkpoint", required=True, help="a global_step_N checkpoint dir")
    parser.add_argument("--out", required=True, help="directory to write the HF model into")
    parser.add_argument(
        "--critic",
        action="store_true",
        help="export the PPO critic (value model) instead of the actor",
    )


def main(args: argparse.Namespace) -> int:
    """Verify the checkpoint, load it into a one-rank engine and export it."""
    from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint

    checkpoint = Path(args.checkpoint)
    try:
        manifest = verify_checkpoint(checkpoint)
    except CorruptCheckpointError as err:
        print(f"trinity-dagster convert: {err}", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(checkpoint, Path(args.out), critic=args.critic)
    except FileNotFoundError as err:
        print(f"trinity-dagster convert: {err}", file=sys.stderr)
        return 2
    what = "critic" if args.critic else "actor"
    print(f"step {manifest.step} of {checkpoint} ({what}) -> {out}")
    return 0


def export_checkpoint(checkpoint: Path, out: Path, *, critic: bool = False) -> Path:
    """Write the actor's (or with `critic`, the critic's) weights of a verified full
    checkpoint as an HF directory at `out`."""
    import tempfile

    from trinity_dagster.checkpoint.layout import CRITIC_DESCRIPTION_DIR, MODEL_DESCRIPTION_DIR
    from trinity_dagster.config import load_config
    from trinity_dagster.engine.engine import TrainEngine

    description = checkpoint / MODEL_DESCRIPTION_DIR
    _require_description(checkpoint, MODEL_DESCRIPTION_DIR, "it was not written by this engine")
    overrides: dict[str, object] = {}
    if critic:
        _require_description(checkpoint, CRITIC_DESCRIPTION_DIR, "its run trained no critic")
        overrides = {
            "algorithm.algorithm_type": "ppo",
            "algorithm.kl_loss_fn": "none",  # no reference model to build
            "critic.model_path": str(checkpoint / CRITIC_DESCRIPTION_DIR),
        }
    with tempfile.TemporaryDirectory(prefix="trinity-convert-") as scratch:
        config = load_config(None, overrides={**overrides, "run_root": scratch})
        engine = TrainEngine(config, description, load_weights=False)
        try:
            engine.load_weights(checkpoint)
            if critic:
                engine.export_critic_hf(out)
            else:
                engine.export_hf(out)
        finally:
            engine.close()
    return out


def _require_description(checkpoint: Path, name: str, otherwise: str) -> None:
    """Refuse a checkpoint without `name`/config.json, saying what its absence means."""
    if not (checkpoint / name / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} has no {name}/config.json: {otherwise}")
