"""The CPU layer: off with CUDA, on without it, and Megatron runs forward/backward under it.

It changes process-wide state, so each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trinity_dagster.engine.cpu_compat import cpu_compat_needed

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decision_follows_cuda_availability() -> None:
    assert cpu_compat_needed(cuda_available=True) is False
    assert cpu_compat_needed(cuda_available=False) is True
    assert cpu_compat_needed() is (not torch.cuda.is_available())


def test_inactive_when_cuda_is_available() -> None:
    result = run_python(
        """
        import json, torch
        torch.cuda.is_available = lambda: True
        current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
        from trinity_dagster.engine import cpu_compat
        activated = cpu_compat.enable_cpu_compat()
        print(json.dumps({
            "activated": activated,
            "active": cpu_compat.cpu_compat_active(),
            "modes": torch._C._len_torch_function_stack(),
            "patched": torch.cuda.current_device is not current_device
                       or torch.cuda.synchronize is not synchronize,
        }))
        """
    )
    assert result == {"activated": False, "active": False, "modes": 0, "patched": False}


@NO_CUDA
def test_active_on_cpu_maps_cuda_to_cpu() -> None:
    result = run_python(
        """
        import json, torch
        from trinity_dagster.engine.cpu_compat import enable_cpu_compat
        first, second = enable_cpu_compat(), enable_cpu_compat()
        x = torch.ones(3)
        made = [
            torch.zeros(2, device="cuda").device.type,
            torch.empty(2, device=torch.cuda.current_device()).device.type,
            torch.tensor([1.0], device=torch.device("cuda", 0)).device.type,
            x.cuda().device.type,
            x.to("cuda:0").device.type,
            x.to(0, torch.float64).dtype == torch.float64,
        ]
        torch.cuda.synchronize()
        print(json.dumps({
            "first": first, "second": second, "made": made,
            "modes": torch._C._len_torch_function_stack(),
            "type": x.type(), "double_type": x.double().type(),
            "cast": x.type(torch.float64).dtype == torch.float64,
        }))
        """
    )
    assert result == {
        "first": True,
        "second": True,
        "made": ["cpu", "cpu", "cpu", "cpu", "cpu", True],
        "modes": 1,
        "type": "torch.cuda.FloatTensor",
        "double_type": "torch.cuda.DoubleTensor",
        "cast": True,
    }


@NO_CUDA
def test_megatron_rng_streams_are_cpu_generators_seeded_like_megatron() -> None:
    # Megatron seeds the tensor-parallel stream with seed + 2718 + tp_rank.
    result = run_python(
        """
        import json, torch
        from megatron.core import tensor_parallel
        from trinity_dagster.config import MegatronConfig
        from trinity_dagster.engine.parallel import destroy_distributed, init_distributed
        info = init_distributed(MegatronConfig(), seed=5)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(3).tolist()
        with tracker.fork():
            b = torch.rand(3).tolist()
        restored = torch.equal(before, torch.get_rng_state())
        ref = torch.Generator().manual_seed(5 + 2718)
        expected = torch.rand(6, generator=ref).tolist()
        default = torch.rand(2).tolist()
        destroy_distributed()
        print(json.dumps({"stream": a + b, "expected": expected, "restored": restored,
                          "default": default, "default_expected":
                          torch.rand(2, generator=torch.Generator().manual_seed(5)).tolist(),
                          "backend": info.backend, "cpu_compat": info.cpu_compat}))
        """
    )
    assert result["stream"] == result["expected"]
    assert result["restored"] is True
    assert result["default"] == result["default_expected"]
    assert (result["backend"], result["cpu_compat"]) == ("gloo", True)


@NO_CUDA
def test_megatron_forward_backward_on_cpu() -> None:
    result = run_python(
        """
        import json, torch
        from trinity_dagster.config import MegatronConfig
        from trinity_dagster.engine.model import build_gpt_model, model_logits
        from trinity_dagster.engine.parallel import destroy_distributed, init_distributed
        cfg = MegatronConfig()
        init_distributed(cfg, seed=0)
        hf = dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, tie_word_embeddings=True)
        model = build_gpt_model(hf, cfg)
        tokens = torch.randint(0, 40, (2, 5))
        logits = model_logits(model, tokens)
        logits.logsumexp(-1).mean().backward()
        grads = [p.grad for p in model.parameters()]
        destroy_distributed()
        print(json.dumps({
            "shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
            "device": logits.device.type,
            "all_grads": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        }))
        """
    )
    assert result == {"shape": [2, 5, 40], "finite": True, "device": "cpu", "all_grads": True}
