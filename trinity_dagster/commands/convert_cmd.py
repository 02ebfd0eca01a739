"""`trinity-dagster convert --checkpoint DIR --out DIR`: a full checkpoint to an HF directory.

For checkpoints saved with `save_hf_checkpoint: never` (or any other). The checkpoint is
verified against its manifest first; its `model/` holds the HF config and tokenizer, and
dist_checkpointing reshards whatever parallel layout it was saved with onto one rank.
"""

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `convert`."""
    parser.add_argument("--checkpoint", required=True, help="a global_step_N checkpoint dir")
    parser.add_argument("--out", required=True, help="directory to write the HF model into")


def main(args: argparse.Namespace) -> int:
    """Verify the checkpoint, load it into a one-rank engine and export it."""
    from trinity_dagster.checkpoint.manifest import CorruptCheckpointError, verify_checkpoint

    checkpoint = Path(args.checkpoint)
    try:
        manifest = verify_checkpoint(checkpoint)
    except CorruptCheckpointError as err:
        print(f"trinity-dagster convert: {err}", file=sys.stderr)
        return 2
    out = export_checkpoint(checkpoint, Path(args.out))
    print(f"step {manifest.step} of {checkpoint} -> {out}")
    return 0


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """Write the weights of a verified full checkpoint as an HF directory at `out`."""
    import tempfile

    from trinity_dagster.checkpoint.layout import MODEL_DESCRIPTION_DIR
    from trinity_dagster.config import load_config
    from trinity_dagster.engine.engine import TrainEngine

    description = checkpoint / MODEL_DESCRIPTION_DIR
    if not (description / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no {MODEL_DESCRIPTION_DIR}/config.json: it was not written by "
            "this engine"
        )
    with tempfile.TemporaryDirectory(prefix="trinity-convert-") as scratch:
        config = load_config(None, overrides={"run_root": scratch})
        engine = TrainEngine(config, description, load_weights=False)
        try:
            engine.load_weights(checkpoint)
            engine.export_hf(out)
        finally:
            engine.close()
    return out
