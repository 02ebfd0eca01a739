"""The prepared GPU check: the Megatron engine on one GPU, with every figure in one JSON line.

Run it through `scripts/gpu_check.sh` (which installs the carried wheels on a machine without
megatron-core); `--dry-run` runs the same code on CPU with a tiny model. Phases:

1. parity: the tiny test-shaped Llama (vocab 99, hidden 32, 2 layers, 4 heads / 2 KV heads,
   untied) trains one fp32 GRPO step on a right-padded batch, once on the GPU in this process
   and once on the CPU in a subprocess that sees no CUDA device (so the engine's CPU layer is
   active there); the policy loss and every parameter's gradient must agree within 1e-4
   (gradients: max |g_cpu - g_gpu| <= 1e-4 * max(1, max |g_cpu|)).
2. throughput: a Qwen2-0.5B-shaped model (vocab 151936, hidden 896, 24 layers, 14 heads /
   2 KV heads, ffn 4864, tied embeddings, q/k/v biases) at random init, bf16 parameters,
   Megatron's local layer spec, trains `warmup + steps` GRPO steps on full-length rows
   (half prompt, half response); tokens/s and MFU from the median measured step.
   MFU = model FLOPs per second / 989e12 (H100/H200 SXM bf16 dense peak), where model FLOPs
   per step = 6 * N * T + 12 * L * d_attn * S * T (N parameters with the tied embedding
   counted once, as the output projection; T tokens in the step; L layers; d_attn = heads *
   head_dim; S the sequence length; attention without a causal discount, as in PaLM's
   appendix B). Nothing else counts: no recomputed log-probs, no reference model.
3. checkpoint: a full engine state (weights, optimizer, scheduler, RNG) saved blocking,
   one more step trained, the state loaded back: save and load seconds, the size, and
   whether the loaded weights equal the saved ones.
4. export: the weights published as a Hugging Face safetensors directory (`export_hf`):
   seconds, size, and whether its tensor names and shapes are the source directory's.

A phase that fails is recorded under `errors` and the phases after it still run where they
can. The last line on stdout is one JSON object (also written to `--out`); the exit status
is 0 only when every phase ran and every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.synthetic import grpo_batch, make_llama_dir

PEAK_BF16_FLOPS = 989e12
MFU_FORMULA = "(6 * params * tokens + 12 * layers * hidden_attn * seq * tokens) / step_s / 989e12"
TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """A Qwen2-style model shape."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int


@dataclass(frozen=True)
class Plan:
    """What the throughput phase trains: the model shape and the batches."""

    shape: Shape
    seq: int
    batch: int
    micro_batch: int
    group: int
    warmup: int
    steps: int


QWEN2_0_5B = Shape(
    vocab=151936, hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, max_positions=32768
)
FULL = Plan(QWEN2_0_5B, seq=1024, batch=64, micro_batch=8, group=8, warmup=2, steps=6)
DRY_RUN = Plan(
    Shape(vocab=512, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, max_positions=128),
    seq=32,
    batch=8,
    micro_batch=4,
    group=4,
    warmup=1,
    steps=2,
)
# The engine tests' tiny model (tests/engine_workers/train_common.py): odd vocabulary, GQA.
PARITY_MODEL = {"vocab": 99, "hidden": 32, "ffn": 64, "layers": 2, "heads": 4, "seq": 32}
PARITY_ROWS = 8
# Every figure the phases report; null in the JSON line when its phase failed.
FIGURES = (
    "model_build_s",
    "params",
    "step_s",
    "step_s_all",
    "tokens_per_step",
    "tokens_per_s",
    "model_flops_per_step",
    "achieved_tflops",
    "mfu",
    "losses",
    "loss_finite",
    "peak_memory_gib",
    "checkpoint_save_s",
    "checkpoint_load_s",
    "checkpoint_mib",
    "resume_matches",
    "export_hf_s",
    "export_mib",
    "export_matches",
    "parity_devices",
    "parity_loss_abs_diff",
    "parity_metrics_max_abs_diff",
    "parity_grad_max_abs_diff",
    "parity_grad_max",
    "parity_tolerance",
    "parity_passed",
)


def log(message: str) -> None:
    """Progress on stderr, so that stdout ends with the JSON line."""
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def make_qwen2_dir(path: Path, shape: Shape, dtype: torch.dtype) -> Path:
    """A random Qwen2 model of `shape` (seed 0) saved in `dtype` with transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def engine_config(run_root: Path, plan: Plan, *, dtype: str, grad_clip: float, total_steps: int):
    """The TrinityConfig of a single-process engine for `plan` (GRPO, RL from step 1)."""
    from trinity_dagster.config import config_from_dict

    return config_from_dict(
        {
            "run_root": str(run_root),
            "model": {
                "max_prompt_tokens": plan.seq // 2,
                "max_response_tokens": plan.seq - plan.seq // 2,
                "max_position_embeddings": plan.shape.max_positions,
            },
            "algorithm": {"algorithm_type": "grpo", "repeat_times": plan.group},
            "buffer": {"train_batch_size": plan.batch},
            "trainer": {
                "micro_batch_size": plan.micro_batch,
                "total_steps": total_steps,
                "sft_warmup_steps": 0,
                "sft_lr": None,
                "optim": {"lr": 1e-5, "grad_clip": grad_clip},
            },
            "megatron": {"params_dtype": dtype, "transformer_impl": "local"},
        }
    )


def padded_grpo_batch(seed: int, *, rows: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """`grpo_batch` with rows right-padded to varied lengths (the explicit-mask path)."""
    gen = torch.Generator().manual_seed(seed)
    batch = grpo_batch(gen, rows=rows, seq=seq, vocab=vocab)
    lengths = torch.randint(seq // 2 + 1, seq + 1, (rows,), generator=gen)
    lengths[0] = seq  # one full row keeps the batch's width
    keep = torch.arange(seq)[None, :] < lengths[:, None]
    batch["tokens"] = torch.where(keep, batch["tokens"], torch.zeros((), dtype=torch.int64))
    batch["attention_mask"] = keep
    batch["response_mask"] = batch["response_mask"] & keep
    batch["old_logprobs"] = torch.where(keep, batch["old_logprobs"], torch.zeros(()))
    return batch


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing on CPU), so wall times are complete."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def dir_mib(path: Path) -> float:
    """Size of every file under `path`, in MiB."""
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 2)


def significant(value: float, digits: int = 4) -> float:
    """`value` rounded to `digits` significant digits (tiny CPU figures stay non-zero)."""
    return float(f"{value:.{digits}g}")


def model_flops(params: int, shape: Shape, seq: int, tokens: int) -> float:
    """Model FLOPs of one training step (forward + backward), see the module docstring."""
    hidden_attn = shape.heads * (shape.hidden // shape.heads)
    return 6.0 * params * tokens + 12.0 * shape.layers * hidden_attn * seq * tokens


# -- parity ---------------------------------------------------------------------------------


def parity_side(hf_dir: Path, run_root: Path) -> dict[str, Any]:
    """One fp32 GRPO step of the tiny model on this process's device: metrics and gradients."""
    from trinity_dagster.engine.engine import TrainEngine
    from trinity_dagster.engine.model import unwrap_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seq = PARITY_MODEL["seq"]
    shape = Shape(
        vocab=PARITY_MODEL["vocab"],
        hidden=PARITY_MODEL["hidden"],
        ffn=PARITY_MODEL["ffn"],
        layers=PARITY_MODEL["layers"],
        heads=PARITY_MODEL["heads"],
        kv_heads=PARITY_MODEL["heads"] // 2,
        max_positions=2 * seq,
    )
    plan = Plan(shape, seq=seq, batch=PARITY_ROWS, micro_batch=2, group=4, warmup=0, steps=1)
    config = engine_config(run_root, plan, dtype="float32", grad_clip=0.0, total_steps=2)
    engine = TrainEngine(config, hf_dir)
    try:
        batch = padded_grpo_batch(1, rows=PARITY_ROWS, seq=seq, vocab=shape.vocab)
        metrics = engine.train_step(1, batch)
        grads = {
            name: param.main_grad.detach().float().cpu()
            for name, param in unwrap_model(engine.model).named_parameters()
        }
        return {"device": str(engine.parallel.device), "metrics": metrics, "grads": grads}
    finally:
        engine.close()


def compare_parity(cpu: dict[str, Any], device: dict[str, Any]) -> dict[str, Any]:
    """Loss, metric and gradient differences between the CPU and the device side."""
    loss_diff = abs(cpu["metrics"]["actor/pg_loss"] - device["metrics"]["actor/pg_loss"])
    metric_diff = max(
        abs(value - device["metrics"][key])
        for key, value in cpu["metrics"].items()
        if key.startswith("actor/") and key != "actor/lr"
    )
    if cpu["grads"].keys() != device["grads"].keys():
        raise ValueError(
            f"parity: parameter names differ between the sides: "
            f"{sorted(cpu['grads'].keys() ^ device['grads'].keys())}"
        )
    grad_diff = max(
        float((cpu["grads"][name] - device["grads"][name]).abs().max()) for name in cpu["grads"]
    )
    grad_max = max(float(grad.abs().max()) for grad in cpu["grads"].values())
    return {
        "parity_devices": [cpu["device"], device["device"]],
        "parity_loss_abs_diff": loss_diff,
        "parity_metrics_max_abs_diff": metric_diff,
        "parity_grad_max_abs_diff": grad_diff,
        "parity_grad_max": grad_max,
        "parity_tolerance": TOLERANCE,
        "parity_passed": loss_diff <= TOLERANCE and grad_diff <= TOLERANCE * max(1.0, grad_max),
    }


def start_cpu_parity(hf_dir: Path, work: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """The CPU side of the parity check in a subprocess that sees no CUDA device."""
    out, log_file = work / "parity_cpu.pt", work / "parity_cpu.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--parity-worker", str(hf_dir)]
    with open(log_file, "wb") as sink:
        proc = subprocess.Popen(
            [*command, str(out)], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    return proc, out, log_file


def finish_cpu_parity(proc: subprocess.Popen[bytes], out: Path, log_file: Path) -> dict[str, Any]:
    """The CPU side's result; RuntimeError with the end of its log if it failed."""
    if proc.wait() != 0:
        tail = log_file.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the CPU parity worker exited with {proc.returncode}:\n{tail}")
    return torch.load(out, weights_only=False)


# -- throughput, checkpoint, export ---------------------------------------------------------


def train_steps(engine, plan: Plan, first: int, count: int) -> tuple[list[float], list[float]]:
    """Train steps `first..first+count-1` on full-length batches: (wall seconds, pg losses)."""
    times, losses = [], []
    for step in range(first, first + count):
        batch = grpo_batch(
            torch.Generator().manual_seed(step),
            rows=plan.batch,
            seq=plan.seq,
            vocab=plan.shape.vocab,
            group=plan.group,
        )
        synchronize()
        started = time.perf_counter()
        metrics = engine.train_step(step, batch)
        synchronize()
        times.append(time.perf_counter() - started)
        losses.append(metrics["actor/pg_loss"])
    return times, losses


def throughput(engine, plan: Plan) -> dict[str, Any]:
    """Warm-up and measured steps: tokens/s and MFU of the median measured step."""
    from trinity_dagster.engine.model import unwrap_model

    params = sum(p.numel() for p in unwrap_model(engine.model).parameters())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _, warm_losses = train_steps(engine, plan, 1, plan.warmup)
    times, losses = train_steps(engine, plan, plan.warmup + 1, plan.steps)
    step_s = statistics.median(times)
    tokens = plan.batch * plan.seq
    flops = model_flops(params, plan.shape, plan.seq, tokens)
    all_losses = warm_losses + losses
    return {
        "params": params,
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "model_flops_per_step": flops,
        "achieved_tflops": significant(flops / step_s / 1e12),
        "mfu": significant(flops / step_s / PEAK_BF16_FLOPS),
        "losses": [round(x, 5) for x in all_losses],
        "loss_finite": all(x == x and abs(x) != float("inf") for x in all_losses),
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if torch.cuda.is_available()
            else None
        ),
    }


def checkpoint_round_trip(engine, plan: Plan, ckpt_dir: Path) -> dict[str, Any]:
    """Save the full state, train one more step, load it back; times and whether it matches."""
    from trinity_dagster.engine.model import unwrap_model

    gpt = unwrap_model(engine.model)
    saved_step = engine.step
    saved = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    synchronize()
    started = time.perf_counter()
    engine.save_state(ckpt_dir).wait()
    synchronize()
    save_s = time.perf_counter() - started
    train_steps(engine, plan, saved_step + 1, 1)
    synchronize()
    started = time.perf_counter()
    engine.load_state(ckpt_dir)
    synchronize()
    load_s = time.perf_counter() - started
    matches = engine.step == saved_step and all(
        torch.equal(saved[name], p) for name, p in gpt.named_parameters()
    )
    return {
        "checkpoint_save_s": round(save_s, 3),
        "checkpoint_load_s": round(load_s, 3),
        "checkpoint_mib": dir_mib(ckpt_dir),
        "resume_matches": matches,
    }


def safetensors_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every safetensors file in an HF directory (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def export(engine, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Publish the weights as an HF directory: seconds, size, names and shapes as the source."""
    synchronize()
    started = time.perf_counter()
    engine.export_hf(out_dir)
    synchronize()
    export_s = time.perf_counter() - started
    return {
        "export_hf_s": round(export_s, 3),
        "export_mib": dir_mib(out_dir),
        "export_matches": safetensors_shapes(out_dir) == safetensors_shapes(hf_dir),
    }


# -- driver ---------------------------------------------------------------------------------


@contextlib.contextmanager
def phase(name: str, errors: dict[str, str]) -> Iterator[None]:
    """Run one phase; an exception is logged and recorded under `errors[name]`."""
    started = time.perf_counter()
    log(f"{name} ...")
    try:
        yield
    except Exception as err:
        traceback.print_exc(file=sys.stderr)
        errors[name] = f"{type(err).__name__}: {err}"[:2000]
        log(f"{name} FAILED after {time.perf_counter() - started:.1f} s: {errors[name][:200]}")
    else:
        log(f"{name} done in {time.perf_counter() - started:.1f} s")


def run_check(plan: Plan, *, dry_run: bool, work: Path) -> dict[str, Any]:
    """Every phase, in order; the figures as one flat dict (see the module docstring)."""
    import megatron.core

    from trinity_dagster.engine.engine import TrainEngine

    started = time.perf_counter()
    errors: dict[str, str] = {}
    shape = plan.shape
    result: dict[str, Any] = {
        "check": "gpu_check",
        "dry_run": dry_run,
        "device": device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "model": "qwen2",
        "vocab": shape.vocab,
        "hidden": shape.hidden,
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "ffn": shape.ffn,
        "tied_embeddings": True,
        "dtype": "bfloat16",
        "transformer_impl": "local",
        "seq": plan.seq,
        "batch": plan.batch,
        "micro_batch": plan.micro_batch,
        "warmup_steps": plan.warmup,
        "measured_steps": plan.steps,
        "peak_tflops": PEAK_BF16_FLOPS / 1e12,
        "mfu_formula": MFU_FORMULA,
        **dict.fromkeys(FIGURES),
    }
    parity_hf = work / "parity_hf"
    make_llama_dir(
        parity_hf,
        vocab=PARITY_MODEL["vocab"],
        hidden=PARITY_MODEL["hidden"],
        ffn=PARITY_MODEL["ffn"],
        layers=PARITY_MODEL["layers"],
        heads=PARITY_MODEL["heads"],
        seq=PARITY_MODEL["seq"],
    )
    cpu_worker = start_cpu_parity(parity_hf, work)
    device_side: dict[str, Any] | None = None
    with phase("parity (device side)", errors):
        device_side = parity_side(parity_hf, work / "parity_run")

    engine = None
    hf_dir = work / "hf"
    with phase("build", errors):
        build_started = time.perf_counter()
        make_qwen2_dir(hf_dir, shape, torch.bfloat16)
        config = engine_config(
            work / "run",
            plan,
            dtype="bfloat16",
            grad_clip=1.0,
            total_steps=plan.warmup + plan.steps + 1,
        )
        engine = TrainEngine(config, hf_dir)
        synchronize()
        result["model_build_s"] = round(time.perf_counter() - build_started, 3)
    if engine is not None:
        try:
            with phase("throughput", errors):
                result.update(throughput(engine, plan))
            with phase("checkpoint", errors):
                result.update(checkpoint_round_trip(engine, plan, work / "checkpoint"))
            with phase("export", errors):
                result.update(export(engine, hf_dir, work / "export"))
        finally:
            engine.close()
    with phase("parity (cpu side)", errors):
        cpu_side = finish_cpu_parity(*cpu_worker)
        if device_side is not None:
            result.update(compare_parity(cpu_side, device_side))

    checks = ("loss_finite", "resume_matches", "export_matches", "parity_passed")
    result["errors"] = errors
    result["ok"] = not errors and all(result.get(key) is True for key in checks)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, same code path")
    parser.add_argument("--out", type=Path, help="also write the JSON line to this file")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temp dir)")
    parser.add_argument("--seq", type=int, help="sequence length of the throughput phase")
    parser.add_argument("--batch", type=int, help="rows per step of the throughput phase")
    parser.add_argument("--micro-batch", type=int, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, help="measured steps of the throughput phase")
    parser.add_argument(
        "--parity-worker",
        nargs=2,
        metavar=("HF_DIR", "OUT"),
        help="internal: run the CPU side of the parity check and save it to OUT",
    )
    args = parser.parse_args()
    if args.parity_worker:
        hf_dir, out = (Path(p) for p in args.parity_worker)
        with tempfile.TemporaryDirectory(prefix="gpu-check-parity-") as tmp:
            torch.save(parity_side(hf_dir, Path(tmp) / "run"), out)
        return
    plan = DRY_RUN if args.dry_run else FULL
    overrides = {
        "seq": args.seq,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
    }
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=args.workdir) as tmp:
        result = run_check(plan, dry_run=args.dry_run, work=Path(tmp))
    line = json.dumps(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line, flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
