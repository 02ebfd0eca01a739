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
5. weight_sync: collective weight sync (`trinity_dagster.weight_sync`) of the throughput
   phase's Qwen2 weights (its HF safetensors, bf16, loaded on CPU as the engine's
   `hf_state_dict()` hands them to the sender) from this process to a receiver subprocess
   whose targets are preallocated in bf16, on the GPU where there is one. Backend: with two
   or more GPUs NCCL, the sender on the first GPU and the receiver on the second (NCCL wants
   one GPU per rank); with one GPU gloo (CPU buffers, copied into the GPU targets) and
   `weight_sync_note` says NCCL was not exercised; on CPU gloo. Figures: stage seconds; the
   median of `syncs` transfers as the receiver sees them (joining the group, every bucket,
   the checksums and copies), GB/s, bytes; and, as a baseline, the same tensors (already on
   the sender's transfer device) broadcast one by one, raw, into buffers on the receiver's
   transfer device, in a fresh group of the same backend between the same two processes
   (`weight_sync_vs_raw_ratio` = transfer seconds / raw seconds, both counting the group's
   setup, which `weight_sync_raw_setup_s` shows alone). Checks: the received tensors equal
   the sent ones bit for bit (targets are filled with a byte pattern before each transfer),
   after the timed transfers and again after a refused one; a transfer with a damaged bucket
   (`corrupt_next_transfer`)
   is refused by the receiver with `WeightSyncError`.

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
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.synthetic import grpo_batch, make_llama_dir

if TYPE_CHECKING:
    from trinity_dagster.weight_sync.group import Backend
    from trinity_dagster.weight_sync.sender import WeightSender

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
    syncs: int = 3  # timed transfers of the weight_sync phase


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
    syncs=1,
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
    "weight_sync_backend",
    "weight_sync_note",
    "weight_sync_devices",
    "weight_sync_tensors",
    "weight_sync_buckets",
    "weight_sync_direct_buckets",
    "weight_sync_bytes",
    "weight_sync_stage_s",
    "weight_sync_transfer_s",
    "weight_sync_transfer_s_all",
    "weight_sync_gbps",
    "weight_sync_raw_s",
    "weight_sync_raw_s_all",
    "weight_sync_raw_setup_s",
    "weight_sync_raw_gbps",
    "weight_sync_vs_raw_ratio",
    "weight_sync_bit_identical",
    "weight_sync_corruption_caught",
)
# The weight_sync phase: its group's timeout (the sender's `sync_timeout`), how long the
# driver waits for one answer of the receiver subprocess, and the loopback both use.
SYNC_TIMEOUT_S = 120.0
WORKER_TIMEOUT_S = 300.0
LOOPBACK = "127.0.0.1"
NCCL_NOT_EXERCISED = (
    "NCCL was not exercised: it needs two GPUs (one per rank; NCCL refuses two ranks on one "
    "device) and this machine has one, so the transfer ran over gloo (CPU buffers, copied "
    "into the receiver's GPU targets)"
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
            # the demo's GRPO loss: no reference model (the MFU formula counts the actor
            # alone) and no dual-clip, so random old log-probs still leave gradients
            "algorithm": {
                "algorithm_type": "grpo",
                "repeat_times": plan.group,
                "clip_range_high": 0.28,
                "dual_clip": None,
                "kl_loss_fn": "none",
            },
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


# -- weight sync ----------------------------------------------------------------------------


def sync_backend() -> tuple[Backend, str, str | None]:
    """(backend, the receiver's target device, a note): NCCL between the first two GPUs,
    gloo into the only GPU (NCCL refuses two ranks on one device), gloo on CPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return "nccl", "cuda:1", None
    if count == 1:
        return "gloo", "cuda:0", NCCL_NOT_EXERCISED
    return "gloo", "cpu", None


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def wait_for(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncWorker:
    """The receiving side of the weight_sync phase: a subprocess of this module
    (`--weight-sync-worker`) that answers one JSON request per line on its stdin with one
    JSON line ({"ok": true, ...} or {"ok": false, "error_type", "error"}) on its stdout."""

    def __init__(self, work: Path) -> None:
        self.log_file = work / "weight_sync_worker.log"
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--weight-sync-worker"]
        with open(self.log_file, "wb") as sink:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
            )
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="weight-sync-worker", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def _tail(self) -> str:
        return "\n" + self.log_file.read_text(errors="replace")[-2000:]

    def send(self, request: dict[str, Any]) -> None:
        """Send one request (its answer comes with `reply`)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            raise RuntimeError(f"the weight sync worker is gone ({err}):{self._tail()}") from err

    def reply(self, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
        """The next answer, whatever it says."""
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"the weight sync worker did not answer within {timeout_s:.0f} s:{self._tail()}"
            ) from None
        if line is None:
            code = self.proc.wait()
            raise RuntimeError(f"the weight sync worker exited with {code}:{self._tail()}")
        return json.loads(line)

    def reply_ok(self, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
        """The next answer; RuntimeError if it reports a failure."""
        answer = self.reply(timeout_s)
        if not answer["ok"]:
            raise RuntimeError(
                f"the weight sync worker failed: {answer['error_type']}: {answer['error']}"
            )
        return answer

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send a request and return its (successful) answer."""
        self.send(request)
        return self.reply_ok()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within 30 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError):
                self.send({"op": "exit"})
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def import_receiver() -> tuple[Any, type[Exception]]:
    """`receive_described` and `WeightSyncError` (imported in the worker process only)."""
    from trinity_dagster.weight_sync.receiver import WeightSyncError, receive_described

    return receive_described, WeightSyncError


class SyncReceiver:
    """What the worker process holds: its targets and the requests it answers."""

    def __init__(self) -> None:
        self.receive_described, _ = import_receiver()
        self.device = torch.device("cpu")
        self.targets: dict[str, torch.Tensor] = {}
        self.wire: dict[str, torch.Tensor] = {}  # what raw broadcasts land in

    def targets_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Preallocate the targets (name, shape, dtype) on the given device."""
        from trinity_dagster.weight_sync.group import transfer_device

        self.device = torch.device(request["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.targets = {
            name: torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device)
            for name, shape, dtype in request["tensors"]
        }
        wire = transfer_device(request["backend"])
        self.wire = {
            name: target if target.device == wire else torch.zeros_like(target, device=wire)
            for name, target in self.targets.items()
        }
        return {"device": str(self.device)}

    def raw_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join a fresh group and receive every tensor as its own raw broadcast."""
        from trinity_dagster.weight_sync.group import (
            join_store,
            local_address_towards,
            pair_group,
            transfer_device,
        )

        started = time.perf_counter()
        host, port, backend = request["address"], int(request["port"]), request["backend"]
        timeout_s = float(request["timeout_s"])
        store = join_store(host, port, timeout_s)
        bind = local_address_towards(host, port)
        group = pair_group(store, request["prefix"], 1, backend, bind, timeout_s)
        wire = transfer_device(backend)
        group.broadcast(torch.zeros(1, dtype=torch.uint8, device=wire), 0).wait()
        wait_for(wire)
        ready = time.perf_counter()
        for tensor in self.wire.values():
            group.broadcast(raw_bytes(tensor), 0).wait()
        wait_for(wire)
        done = time.perf_counter()
        return {"seconds": done - started, "setup_s": ready - started}

    def receive_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Fill the targets with a byte pattern, then receive a transfer into them."""
        for target in self.targets.values():
            raw_bytes(target).fill_(0xA5)
        wait_for(self.device)
        started = time.perf_counter()
        received = self.receive_described(request["transfer"], self.targets)
        wait_for(self.device)
        return {
            "seconds": time.perf_counter() - started,
            "nbytes": received.nbytes,
            "direct_buckets": received.direct_buckets,
        }

    def compare_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Whether the targets hold the safetensors files' tensors, bit for bit."""
        from safetensors import safe_open

        expected: set[str] = set()
        wrong: list[str] = []
        for file in request["files"]:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    expected.add(name)
                    want, got = handle.get_tensor(name), self.targets.get(name)
                    same = (
                        got is not None
                        and got.dtype == want.dtype
                        and got.shape == want.shape
                        and torch.equal(raw_bytes(got.cpu()), raw_bytes(want))
                    )
                    if not same:
                        wrong.append(name)
        wrong += sorted(set(self.targets) - expected)
        return {"identical": not wrong, "compared": len(expected), "wrong": wrong[:5]}


def sync_worker_main() -> None:
    """The worker's loop: one JSON request per stdin line, one JSON answer per stdout line."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray output (NCCL, warnings): the log
    receiver = SyncReceiver()
    handlers = {
        "targets": receiver.targets_op,
        "raw": receiver.raw_op,
        "receive": receiver.receive_op,
        "compare": receiver.compare_op,
    }
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        try:
            answer = {"ok": True, **handlers[request["op"]](request)}
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            answer = {"ok": False, "error_type": type(err).__name__, "error": str(err)[:2000]}
        answers.write(json.dumps(answer) + "\n")


def sender_record(sender: WeightSender, receiver: str) -> dict[str, Any]:
    """The sender's record of its transfer to `receiver` (waits for the sending thread)."""
    deadline = time.monotonic() + SYNC_TIMEOUT_S + 30
    while time.monotonic() < deadline:
        for record in list(sender.transfers):
            if record["receiver"] == receiver:
                return record
        time.sleep(0.01)
    raise TimeoutError(f"the sender kept no record of its transfer to {receiver}")


def sync_transfer(sender: WeightSender, worker: SyncWorker, receiver: str) -> tuple[dict, dict]:
    """One transfer of version 1 into the targets: (the receiver's answer, the sender's
    record)."""
    transfer = sender.open_transfer(1, receiver)
    worker.send({"op": "receive", "transfer": transfer})
    answer = worker.reply()
    return answer, sender_record(sender, receiver)


def good_transfer(sender: WeightSender, worker: SyncWorker, receiver: str) -> dict[str, Any]:
    """A transfer both sides report whole; RuntimeError otherwise."""
    answer, record = sync_transfer(sender, worker, receiver)
    if not answer["ok"] or not record["ok"]:
        raise RuntimeError(
            f"transfer to {receiver} failed: receiver "
            f"{answer.get('error_type')}: {answer.get('error')}; sender {record.get('error')}"
        )
    return answer


def raw_broadcast(
    sender: WeightSender, worker: SyncWorker, wire: list[torch.Tensor], prefix: str
) -> dict:
    """The baseline: every tensor broadcast alone in a fresh group of the sender's backend."""
    from trinity_dagster.weight_sync.group import pair_group

    worker.send(
        {
            "op": "raw",
            "address": sender.address,
            "port": sender.port,
            "prefix": prefix,
            "backend": sender.backend,
            "timeout_s": sender.timeout_s,
        }
    )
    group = pair_group(sender.store, prefix, 0, sender.backend, sender.bind_host, SYNC_TIMEOUT_S)
    device = wire[0].device
    group.broadcast(torch.ones(1, dtype=torch.uint8, device=device), 0).wait()
    for tensor in wire:
        group.broadcast(tensor, 0).wait()
    wait_for(device)
    return worker.reply_ok()


def weight_sync(worker: SyncWorker, source: Path, syncs: int) -> dict[str, Any]:
    """Stage the weights in `source`, time raw broadcasts and transfers, check them."""
    from safetensors.torch import load_file

    from trinity_dagster.weight_sync.group import transfer_device
    from trinity_dagster.weight_sync.sender import WeightSender

    backend, receiver_device, note = sync_backend()
    if backend == "nccl":
        torch.cuda.set_device(0)  # the sender's rank; its sending thread uses device 0 too
    files = sorted(source.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    specs = [
        [name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()
    ]
    targets = worker.ask(
        {"op": "targets", "tensors": specs, "device": receiver_device, "backend": backend}
    )
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sender = WeightSender(LOOPBACK, LOOPBACK, SYNC_TIMEOUT_S, backend=backend)
    try:
        started = time.perf_counter()
        layout = sender.stage(1, tensors)
        stage_s = time.perf_counter() - started
        device = transfer_device(sender.backend)
        wire = [raw_bytes(t).to(device) for t in tensors.values()]
        raw = [raw_broadcast(sender, worker, wire, f"gpu_check/raw/{i}/") for i in range(syncs)]
        del wire
        timed = [good_transfer(sender, worker, f"gpu_check-{i}") for i in range(syncs)]
        identical = worker.ask({"op": "compare", "files": [str(f) for f in files]})
        log("weight_sync: a transfer with a damaged bucket follows; its failure is expected")
        sender.corrupt_next_transfer(bucket=0)
        refused, record = sync_transfer(sender, worker, "gpu_check-damaged")
        good_transfer(sender, worker, "gpu_check-after-damaged")
        identical_after = worker.ask({"op": "compare", "files": [str(f) for f in files]})
    finally:
        sender.close()
    for check in (identical, identical_after):
        if not check["identical"]:
            log(f"weight_sync: tensors differ from the sent ones: {check['wrong']}")
    caught = (
        not refused["ok"]
        and refused["error_type"] == "WeightSyncError"
        and "damaged" in refused["error"]
        and record["ok"] is False
    )
    if not caught:
        log(f"weight_sync: the damaged transfer was not refused as expected: {refused} {record}")
    transfer_s = statistics.median(answer["seconds"] for answer in timed)
    raw_s = statistics.median(answer["seconds"] for answer in raw)
    return {
        "weight_sync_backend": backend,
        "weight_sync_note": note,
        "weight_sync_devices": [str(device), targets["device"]],
        "weight_sync_tensors": len(tensors),
        "weight_sync_buckets": len(layout.buckets),
        "weight_sync_direct_buckets": timed[-1]["direct_buckets"],
        "weight_sync_bytes": layout.nbytes,
        "weight_sync_stage_s": significant(stage_s),
        "weight_sync_transfer_s": significant(transfer_s),
        "weight_sync_transfer_s_all": [significant(a["seconds"]) for a in timed],
        "weight_sync_gbps": significant(layout.nbytes / transfer_s / 1e9),
        "weight_sync_raw_s": significant(raw_s),
        "weight_sync_raw_s_all": [significant(a["seconds"]) for a in raw],
        "weight_sync_raw_setup_s": significant(statistics.median(a["setup_s"] for a in raw)),
        "weight_sync_raw_gbps": significant(tensor_bytes / raw_s / 1e9),
        "weight_sync_vs_raw_ratio": significant(transfer_s / raw_s),
        "weight_sync_bit_identical": identical["identical"] and identical_after["identical"],
        "weight_sync_corruption_caught": caught,
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
    sync_worker = SyncWorker(work)  # imports torch and the receiver while the phases run
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
    with phase("weight_sync", errors):
        try:
            source = hf_dir
            if not any(hf_dir.glob("*.safetensors")):  # the build phase failed: make them
                source = make_qwen2_dir(work / "weight_sync_hf", shape, torch.bfloat16)
            result.update(weight_sync(sync_worker, source, plan.syncs))
        finally:
            sync_worker.close()

    checks = (
        "loss_finite",
        "resume_matches",
        "export_matches",
        "parity_passed",
        "weight_sync_bit_identical",
        "weight_sync_corruption_caught",
    )
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
    parser.add_argument("--syncs", type=int, help="timed transfers of the weight_sync phase")
    parser.add_argument(
        "--parity-worker",
        nargs=2,
        metavar=("HF_DIR", "OUT"),
        help="internal: run the CPU side of the parity check and save it to OUT",
    )
    parser.add_argument(
        "--weight-sync-worker",
        action="store_true",
        help="internal: the receiving side of the weight_sync phase (JSON lines on stdin)",
    )
    args = parser.parse_args()
    if args.weight_sync_worker:
        sync_worker_main()
        return
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
        "syncs": args.syncs,
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
