"""`scripts/gpu_check.sh --dry-run`: the prepared GPU check's code path, on CPU with a tiny model.

The GPU run itself needs a GPU machine; this keeps its script, phases and JSON line working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import benchmarks.gpu_check as gpu_check
from benchmarks.gpu_check import DRY_RUN, FIGURES, MFU_FORMULA, model_flops

REPO = Path(__file__).resolve().parents[1]
# Two processes each import torch and megatron-core and train bf16 steps (emulated on this
# CPU), a third receives the synced weights: 25-35 s on this 2-core machine beside light
# other work (23-31 s before the weight_sync phase), more under load.
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the JSON line on stdout, the --out file's JSON) of one dry run."""
    out = tmp_path_factory.mktemp("gpu-check") / "result.json"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), json.loads(out.read_text())


def _qwen2_params() -> int:
    """Parameters of the dry run's Qwen2 shape: tied embedding, q/k/v biases, RMSNorms."""
    s = DRY_RUN.shape
    head = s.hidden // s.heads
    q, kv = s.heads * head, s.kv_heads * head
    layer = (
        2 * s.hidden + s.hidden * (q + 2 * kv) + q + 2 * kv + q * s.hidden + 3 * s.hidden * s.ffn
    )
    return s.vocab * s.hidden + s.layers * layer + s.hidden


@slow
def test_the_dry_run_reports_every_figure_with_sane_values(
    dry_run: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    result, written = dry_run
    assert written == result
    assert set(FIGURES) <= result.keys()
    assert result["dry_run"] is True and result["device"] == "cpu"
    assert result["dtype"] == "bfloat16" and result["transformer_impl"] == "local"
    assert result["mfu_formula"] == MFU_FORMULA and result["peak_tflops"] == 989.0
    assert result["params"] == _qwen2_params()
    tokens = DRY_RUN.batch * DRY_RUN.seq
    assert result["tokens_per_step"] == tokens
    assert result["model_flops_per_step"] == model_flops(
        result["params"], DRY_RUN.shape, DRY_RUN.seq, tokens
    )
    assert len(result["step_s_all"]) == DRY_RUN.steps
    assert len(result["losses"]) == DRY_RUN.warmup + DRY_RUN.steps
    assert result["loss_finite"] is True
    assert result["step_s"] > 0
    assert result["tokens_per_s"] == pytest.approx(tokens / result["step_s"], rel=1e-3)
    assert 0 < result["mfu"] < 1
    assert result["model_build_s"] > 0
    # Both parity sides run on the CPU here: the same code, so no difference at all.
    assert result["parity_devices"] == ["cpu", "cpu"]
    assert result["parity_passed"] is True
    assert result["parity_loss_abs_diff"] <= 1e-4
    assert result["parity_grad_max_abs_diff"] <= 1e-4 * max(1.0, result["parity_grad_max"])
    assert result["parity_grad_max"] > 0
    assert result["export_matches"] is True
    assert result["export_hf_s"] > 0 and result["export_mib"] > 0
    assert 0 < result["wall_s"] < 600


@slow
def test_the_dry_run_passes_the_checkpoint_round_trip(
    dry_run: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    result, _ = dry_run
    assert result["errors"] == {}
    assert result["resume_matches"] is True
    assert result["checkpoint_save_s"] > 0 and result["checkpoint_load_s"] > 0
    assert result["checkpoint_mib"] > 0
    assert result["ok"] is True


@slow
def test_the_dry_run_syncs_the_weights_bit_for_bit_and_refuses_a_damaged_bucket(
    dry_run: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    result, _ = dry_run
    assert "weight_sync" not in result["errors"]
    # No GPU: gloo between two CPU processes, and nothing to say about NCCL.
    assert result["weight_sync_backend"] == "gloo" and result["weight_sync_note"] is None
    assert result["weight_sync_devices"] == ["cpu", "cpu"]
    assert result["weight_sync_bit_identical"] is True
    assert result["weight_sync_corruption_caught"] is True
    layers = DRY_RUN.shape.layers
    # embed_tokens and the final norm; per layer 2 norms, q/k/v weights and biases, o, MLP x3.
    tensors = 2 + 12 * layers
    assert result["weight_sync_tensors"] == tensors
    bf16_bytes = 2 * _qwen2_params()
    assert bf16_bytes <= result["weight_sync_bytes"] < bf16_bytes + 8 * tensors  # word padding
    assert 0 <= result["weight_sync_direct_buckets"] <= result["weight_sync_buckets"]
    assert len(result["weight_sync_transfer_s_all"]) == DRY_RUN.syncs
    assert len(result["weight_sync_raw_s_all"]) == DRY_RUN.syncs
    for key in (
        "weight_sync_stage_s",
        "weight_sync_transfer_s",
        "weight_sync_gbps",
        "weight_sync_raw_s",
        "weight_sync_raw_setup_s",
        "weight_sync_raw_gbps",
        "weight_sync_vs_raw_ratio",
    ):
        assert result[key] > 0, key
    transfer_s, raw_s = result["weight_sync_transfer_s"], result["weight_sync_raw_s"]
    assert result["weight_sync_gbps"] == pytest.approx(
        result["weight_sync_bytes"] / transfer_s / 1e9, rel=1e-3
    )
    assert result["weight_sync_vs_raw_ratio"] == pytest.approx(transfer_s / raw_s, rel=1e-3)
    assert result["weight_sync_raw_setup_s"] <= raw_s


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (0, ("gloo", "cpu", None)),
        (1, ("gloo", "cuda:0", gpu_check.NCCL_NOT_EXERCISED)),
        (2, ("nccl", "cuda:1", None)),
        (8, ("nccl", "cuda:1", None)),
    ],
)
def test_the_weight_sync_backend_follows_the_gpu_count(
    monkeypatch: pytest.MonkeyPatch, devices: int, expected: tuple[str, str, str | None]
) -> None:
    """NCCL needs one GPU per rank: two GPUs or more; gloo into the only GPU, or on CPU."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: devices)
    assert gpu_check.sync_backend() == expected
