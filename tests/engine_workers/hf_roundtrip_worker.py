"""Import HF dirs into Megatron, export them again and save Megatron logits, per case dir.

Usage (plain or under torchrun): hf_roundtrip_worker.py --tp N [--pp M] CASE_DIR [...]
Each CASE_DIR holds `hf/` (the source); this writes `export/` and, with pipeline size 1,
`megatron_logits.pt` (logits [B, T, V], tokens, padding mask) from global rank 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trinity_dagster.config import MegatronConfig
from trinity_dagster.engine.hf_weights import (
    export_model_to_hf,
    hf_state_dict_from_model,
    load_hf_into_model,
)
from trinity_dagster.engine.model import build_gpt_model, model_logits
from trinity_dagster.engine.parallel import destroy_distributed, init_distributed


def sample_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed tokens [2, 9] and a padding mask whose second row ends in 3 pad positions."""
    tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return tokens, mask


def check_state_dict_is_a_snapshot(
    model: torch.nn.Module, hf_config: dict, case: Path, rank: int
) -> None:
    """hf_state_dict_from_model equals the export and does not change when training does."""
    state = hf_state_dict_from_model(model, hf_config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    if rank == 0:
        exported = load_file(case / "export" / "model.safetensors")
        assert sorted(state) == sorted(exported), "state dict names differ from the export"
        for name, tensor in exported.items():
            assert torch.equal(state[name], tensor), f"{name} changed with the model"
    else:
        assert state == {}, "non-zero ranks must get an empty state dict"


def run_case(case: Path, megatron_cfg: MegatronConfig, rank: int) -> None:
    hf_config = json.loads((case / "hf" / "config.json").read_text())
    model = build_gpt_model(hf_config, megatron_cfg, params_dtype=torch.float32)
    load_hf_into_model(model, case / "hf")
    export_model_to_hf(model, hf_config, case / "export", tokenizer_src=case / "hf")
    if megatron_cfg.pipeline_model_parallel_size == 1:
        tokens, mask = sample_batch(hf_config["vocab_size"])
        model.eval()
        with torch.no_grad():
            logits = model_logits(model, tokens, mask)
        if rank == 0:
            saved = {"logits": logits, "tokens": tokens, "mask": mask}
            torch.save(saved, case / "megatron_logits.pt")
    check_state_dict_is_a_snapshot(model, hf_config, case, rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("cases", nargs="+", type=Path)
    args = parser.parse_args()
    megatron_cfg = MegatronConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    info = init_distributed(megatron_cfg, seed=0)
    try:
        for case in args.cases:
            run_case(case, megatron_cfg, info.rank)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
