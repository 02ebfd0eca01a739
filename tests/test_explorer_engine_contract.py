"""The contract between explorer and trainer: the engine recomputes the explorer's log-probs.

The rows' `logprobs` must equal what the Megatron engine computes for the same tokens from the
same weights (`token_logprobs_and_entropy` at `explorer.temperature`), so a fresh batch has
importance ratio 1. Megatron's parallel state is global, so the engine side runs in a fresh
process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trinity_dagster.checkpoint.initial_weights import create_initial_model
from trinity_dagster.config import load_config
from trinity_dagster.explorer.explorer import Explorer
from trinity_dagster.paths import RunPaths

REPO = Path(__file__).resolve().parents[1]

ENGINE_SIDE = """
import json, sys
from pathlib import Path
import torch
from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.hf_weights import load_hf_into_model
from trinity_dagster.engine.model import build_gpt_model, local_logits
from trinity_dagster.engine.parallel import destroy_distributed, init_distributed
from trinity_dagster.engine.train_step import token_logprobs_and_entropy

hf_dir, rows_file, out_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[4])
temperature = float(sys.argv[3])
rows = json.loads(rows_file.read_text())
cfg = MegatronConfig()
init_distributed(cfg, seed=0)
try:
    hf_config = json.loads((hf_dir / "config.json").read_text())
    model = build_gpt_model(hf_config, cfg, params_dtype=torch.float32)
    load_hf_into_model(model, hf_dir)
    model.eval()
    width = max(len(r["tokens"]) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r["tokens"])] = torch.tensor(r["tokens"])
        mask[i, : len(r["tokens"])] = 1
    with torch.no_grad():
        logprobs, _ = token_logprobs_and_entropy(
            local_logits(model, tokens, mask), tokens, temperature=temperature, entropy_grad=False
        )
    out = [logprobs[i, r["prompt_length"] : len(r["tokens"])].tolist() for i, r in enumerate(rows)]
    out_file.write_text(json.dumps(out))
finally:
    destroy_distributed()
"""


@pytest.mark.slow
def test_engine_recomputes_the_explorer_logprobs(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        {
            "run_root": str(tmp_path / "run"),
            "algorithm.repeat_times": 4,
            "explorer.tasks_per_step": 3,
            "explorer.temperature": 0.8,
            "explorer.top_p": 0.95,
        },
    )
    paths = RunPaths.of(cfg.run_root)
    hf_dir = create_initial_model(cfg, paths)
    rows = Explorer(cfg, paths).explore(step=2)
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(
        json.dumps([{"tokens": r["tokens"], "prompt_length": r["prompt_length"]} for r in rows])
    )
    out_file = tmp_path / "engine_logprobs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-c", ENGINE_SIDE, str(hf_dir), str(rows_file), "0.8", str(out_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    engine = json.loads(out_file.read_text())
    for row, recomputed in zip(rows, engine, strict=True):
        assert recomputed == pytest.approx(row["logprobs"], abs=1e-4)
