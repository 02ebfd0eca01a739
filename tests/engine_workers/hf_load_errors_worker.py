"""Try loading bad HF dirs into a model built from a good one; print the errors as JSON.

Usage: hf_load_errors_worker.py GOOD_HF_DIR BAD_DIR [BAD_DIR ...]
Prints one JSON object {BAD_DIR: "ErrorType: message" or "loaded"} as the last line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.hf_weights import load_hf_into_model
from trinity_dagster.engine.model import build_gpt_model
from trinity_dagster.engine.parallel import destroy_distributed, init_distributed


def main() -> None:
    good, *bad = (Path(a) for a in sys.argv[1:])
    megatron_cfg = MegatronConfig()
    init_distributed(megatron_cfg, seed=0)
    results = {}
    try:
        model = build_gpt_model(json.loads((good / "config.json").read_text()), megatron_cfg)
        for directory in bad:
            try:
                load_hf_into_model(model, directory)
                results[str(directory)] = "loaded"
            except Exception as err:
                results[str(directory)] = f"{type(err).__name__}: {err}"
    finally:
        destroy_distributed()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
