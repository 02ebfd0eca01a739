"""Seconds per weight sync of each sync method, from the sender's tensors to the receiver's model.

A sync starts with the sender holding a weights version as a dict of HF-named CPU tensors and
ends when the receiver's loaded model (a dict of preallocated target tensors of the same
names, shapes and dtype, zeroed before every sync) holds them. Two model shapes:

- `demo`: the tiny Llama `create_initial_model` builds for `examples/demo.yaml` (hidden 128,
  2 layers: under 1 MB, so fixed costs dominate);
- `qwen05b`: a Qwen2-0.5B-shaped state dict built with torch (vocab 151936, hidden 896, 24
  layers, 14 heads / 2 KV heads, ffn 4864, tied embeddings, q/k/v biases: ~1 GB in bf16).

Methods (`--dtype` for the sender's tensors and the targets alike):

- `checkpoint`: `publish_weights` (the HF directory explorers load, fsynced and renamed, the
  demo model's tokenizer files copied), then `safetensors.torch.load_file` of its weights
  and `copy_` into the targets; parts `publish_s`, `load_s`.
- `memory`: `write_shm_weights` into /dev/shm, then `read_shm_weights` and `copy_`; parts
  `write_s`, `read_s`.
- `nccl` (gloo on CPU): `WeightSender.stage` and `open_transfer` here, `receive_described`
  in a separate, long-lived receiver process; timed here from before `stage` until the
  receiver reports completion; parts `stage_s` and `transfer_s` (as the receiver measured
  it: joining the transfer's group, receiving, checking and copying).
- baseline `raw_broadcast`: a plain two-process gloo group (set up once, untimed) between this
  process (rank 0, the same tensors) and the receiver process (rank 1, its targets), one
  `broadcast` per tensor, timed on the receiver from a barrier to the last broadcast's end.

The checkpoint and memory receivers run in this process (they read files, as a local
explorer would). Methods are interleaved within each round, so each sees the same load;
after every method's last sync, a CRC of its targets must match the sender's tensors.
Bytes moved: the safetensors file (`checkpoint`), the shared-memory region (`memory`),
`WeightSender.layout_bytes` (`nccl`), the tensors' bytes (`raw_broadcast`, `<shape>_bytes`).

Each shape first syncs `--warmup` untimed rounds of every method (fresh memory is slow to
fault in on a VM that hands freed pages back to its host: the first rounds run up to several
times slower), then each figure is the median of `--repeats`; the last line printed is one
JSON object, whose `nccl_vs_raw_broadcast_ratio` (goal <= 1.2) and `nccl_vs_checkpoint_ratio`
(goal <= 1.0) are the qwen05b shape's (the demo's carry a `demo_` prefix). Torch runs with
`--threads` intra-op threads in each of the two processes (1: on a 2-core machine sender and
receiver then have a core each, as the repository's other benchmarks run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trinity_dagster.paths import RunPaths

SHAPES = ("demo", "qwen05b")
METHODS = ("checkpoint", "memory", "nccl", "raw_broadcast")
REMOTE = ("nccl", "raw_broadcast")  # received in the receiver process
HEADLINE_SHAPE = "qwen05b"  # its ratios are reported without a prefix
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
HOST = "127.0.0.1"
TIMEOUT_S = 300.0
QWEN05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
}

Tensors = dict[str, torch.Tensor]
Spec = tuple[str, tuple[int, ...], str]  # name, shape, dtype: what the receiver allocates


def qwen05b_tensors(dtype: torch.dtype) -> Tensors:
    """Random tensors with the HF names and shapes of Qwen2-0.5B (tied embeddings)."""
    hidden, ffn = QWEN05B["hidden_size"], QWEN05B["intermediate_size"]
    kv = QWEN05B["num_key_value_heads"] * hidden // QWEN05B["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (QWEN05B["vocab_size"], hidden)
    }
    for i in range(QWEN05B["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update(
            {
                f"{layer}self_attn.q_proj.weight": (hidden, hidden),
                f"{layer}self_attn.q_proj.bias": (hidden,),
                f"{layer}self_attn.k_proj.weight": (kv, hidden),
                f"{layer}self_attn.k_proj.bias": (kv,),
                f"{layer}self_attn.v_proj.weight": (kv, hidden),
                f"{layer}self_attn.v_proj.bias": (kv,),
                f"{layer}self_attn.o_proj.weight": (hidden, hidden),
                f"{layer}mlp.gate_proj.weight": (ffn, hidden),
                f"{layer}mlp.up_proj.weight": (ffn, hidden),
                f"{layer}mlp.down_proj.weight": (hidden, ffn),
                f"{layer}input_layernorm.weight": (hidden,),
                f"{layer}post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator, dtype=dtype) * 0.02
        for name, shape in shapes.items()
    }


def qwen05b_config() -> dict[str, Any]:
    """A Qwen2-0.5B HF config, as `publish_weights` writes it beside the weights."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **QWEN05B,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }


def demo_model(root: Path) -> Path:
    """The demo's initial model directory (built from `examples/demo.yaml` under `root`)."""
    from trinity_dagster.checkpoint.initial_weights import create_initial_model
    from trinity_dagster.config import load_config

    config = load_config(DEMO_CONFIG, {"run_root": str(root / "demo-run")})
    return create_initial_model(config, RunPaths.of(config.run_root))


def demo_tensors(model_dir: Path, dtype: torch.dtype) -> Tensors:
    """The demo model's HF tensors, in `dtype`."""
    from safetensors.torch import load_file

    return {name: t.to(dtype) for name, t in load_file(model_dir / "model.safetensors").items()}


def specs_of(tensors: Tensors) -> list[Spec]:
    """What the receiver needs to allocate targets like `tensors`, in their order."""
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()]


def allocate(specs: list[Spec]) -> Tensors:
    """Zeroed (so touched) targets for `specs`."""
    return {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in specs}


def digest(tensors: Tensors) -> int:
    """A CRC of every tensor's bytes, in order (to check that a sync delivered them)."""
    crc = 0
    for tensor in tensors.values():
        crc = zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy().data, crc)
    return crc


def clear(tensors: Tensors) -> None:
    """Zero the targets, so that the next sync must fill them."""
    for tensor in tensors.values():
        tensor.zero_()


def copy_into(targets: Tensors, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the received tensors into the targets of the same names."""
    for name, tensor in tensors.items():
        targets[name].copy_(tensor)


def gloo_pair(store: dist.Store, rank: int) -> dist.ProcessGroup:
    """The raw baseline's two-rank gloo group on loopback (blocks until both ranks joined)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=TIMEOUT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def raw_broadcast(group: dist.ProcessGroup, tensors: Tensors) -> float:
    """A barrier, then one broadcast per tensor from rank 0; seconds after the barrier."""
    group.barrier().wait()
    started = time.perf_counter()
    for tensor in tensors.values():
        group.broadcast(tensor, 0).wait()
    return time.perf_counter() - started


def receiver_main(conn: Connection, specs: list[Spec], threads: int) -> None:
    """The receiver process: allocates the targets once, then serves requests from `conn`.

    Requests: ("nccl", transfer), ("raw_join", port), ("raw",), ("clear",), ("digest",); None
    ends it. Every request is answered.
    """
    from trinity_dagster.weight_sync.receiver import receive_described

    torch.set_num_threads(threads)
    targets = allocate(specs)
    group: dist.ProcessGroup | None = None
    conn.send("ready")
    while (request := conn.recv()) is not None:
        kind = request[0]
        if kind == "nccl":
            received = receive_described(request[1], targets)
            conn.send({"transfer_s": received.seconds, "buckets_direct": received.direct_buckets})
        elif kind == "raw_join":
            store = dist.TCPStore(HOST, request[1], None, False, timedelta(seconds=TIMEOUT_S))
            group = gloo_pair(store, 1)
            conn.send("joined")
        elif kind == "raw":
            assert group is not None, "raw broadcast before raw_join"
            conn.send(raw_broadcast(group, targets))
        elif kind == "clear":
            clear(targets)
            conn.send("cleared")
        elif kind == "digest":
            conn.send(digest(targets))


class ReceiverProcess:
    """The long-lived receiver process of one shape, and the raw baseline's group with it."""

    def __init__(self, specs: list[Spec], threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=receiver_main, args=(child, specs, threads), daemon=True
        )
        self.process.start()
        child.close()
        if self.conn.recv() != "ready":
            raise RuntimeError("the receiver process did not start")
        self._store = dist.TCPStore(
            HOST, 0, None, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False
        )
        self.conn.send(("raw_join", self._store.port))
        self.raw_group = gloo_pair(self._store, 0)
        if self.conn.recv() != "joined":
            raise RuntimeError("the receiver process did not join the raw broadcast group")

    def request(self, *message: Any) -> Any:
        """Send one request and return the answer."""
        self.conn.send(message)
        return self.conn.recv()

    def raw_broadcast(self, tensors: Tensors) -> float:
        """Broadcast `tensors` into the receiver's targets; seconds as the receiver saw them."""
        self.conn.send(("raw",))
        raw_broadcast(self.raw_group, tensors)
        return float(self.conn.recv())

    def close(self) -> None:
        """End the process."""
        self.conn.send(None)
        self.process.join(30)


class ShapeBench:
    """One shape's sender tensors, local targets (checkpoint, memory), sender and receiver."""

    def __init__(
        self,
        tensors: Tensors,
        hf_config: dict[str, Any],
        source_dir: Path,
        root: Path,
        threads: int,
    ) -> None:
        from trinity_dagster.weight_sync.sender import WeightSender

        self.tensors, self.hf_config, self.source_dir = tensors, hf_config, source_dir
        self.paths = RunPaths.of(root)
        self.targets = allocate(specs_of(tensors))
        self.expected = digest(tensors)
        self.sender = WeightSender(HOST, HOST, timeout_s=TIMEOUT_S)
        self.receiver = ReceiverProcess(specs_of(tensors), threads)
        self.bytes: dict[str, int] = {
            "raw_broadcast": sum(t.numel() * t.element_size() for t in tensors.values())
        }
        self.version = 0

    def sync(self, method: str, check: bool) -> dict[str, float]:
        """One sync by `method` into zeroed targets: seconds (`s`) and its parts; with `check`,
        make sure the targets then hold the sender's bytes."""
        remote = method in REMOTE
        if remote:
            self.receiver.request("clear")
        else:
            clear(self.targets)
        self.version += 1
        measure: Callable[[int], dict[str, float]] = getattr(self, f"_{method}")
        parts = measure(self.version)
        if check:
            got = self.receiver.request("digest") if remote else digest(self.targets)
            if got != self.expected:
                raise RuntimeError(f"a {method} sync did not deliver the sender's weights")
        return parts

    def _checkpoint(self, version: int) -> dict[str, float]:
        """Publish `version`, load its safetensors file and copy it into the local targets."""
        from safetensors.torch import load_file

        from trinity_dagster.checkpoint.hf_dir import WEIGHTS_FILE
        from trinity_dagster.checkpoint.publish import publish_weights

        started = time.perf_counter()
        published = publish_weights(
            self.paths, version, self.tensors, self.hf_config, self.source_dir
        )
        written = time.perf_counter()
        copy_into(self.targets, load_file(published / WEIGHTS_FILE))
        done = time.perf_counter()
        self.bytes["checkpoint"] = (published / WEIGHTS_FILE).stat().st_size
        shutil.rmtree(published)  # one version on disk at a time
        return {"s": done - started, "publish_s": written - started, "load_s": done - written}

    def _memory(self, version: int) -> dict[str, float]:
        """Write `version` to shared memory, map it and copy it into the local targets."""
        from trinity_dagster.checkpoint.shm_weights import read_shm_weights, write_shm_weights

        started = time.perf_counter()
        region = write_shm_weights(self.paths, version, self.tensors)
        written = time.perf_counter()
        copy_into(self.targets, read_shm_weights(self.paths, version))
        done = time.perf_counter()
        self.bytes["memory"] = region.stat().st_size
        return {"s": done - started, "write_s": written - started, "read_s": done - written}

    def _nccl(self, version: int) -> dict[str, float]:
        """Stage `version` and transfer it into the receiver process's targets."""
        started = time.perf_counter()
        self.sender.stage(version, self.tensors)
        staged = time.perf_counter()
        answer = self.receiver.request("nccl", self.sender.open_transfer(version, "bench"))
        done = time.perf_counter()
        self.bytes["nccl"] = self.sender.layout_bytes(version)
        return {"s": done - started, "stage_s": staged - started, **answer}

    def _raw_broadcast(self, version: int) -> dict[str, float]:
        """Broadcast the tensors into the receiver process's targets (no version kept)."""
        return {"s": self.receiver.raw_broadcast(self.tensors)}

    def close(self) -> None:
        """End the receiver, the sender and the shared-memory directory."""
        from trinity_dagster.checkpoint.shm_weights import remove_shm_dir

        self.receiver.close()
        self.sender.close()
        remove_shm_dir(self.paths)


def shape_figures(
    name: str, bench: ShapeBench, runs: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    """The medians of one shape's runs, its bytes moved and its ratios, keys prefixed `name_`
    (the ratios of `HEADLINE_SHAPE` without prefix)."""
    figures: dict[str, Any] = {
        f"{name}_tensors": len(bench.tensors),
        f"{name}_bytes": bench.bytes["raw_broadcast"],
    }
    for method, parts in runs.items():
        for key in parts[0]:
            figures[f"{name}_{method}_{key}"] = round(statistics.median(p[key] for p in parts), 4)
        figures[f"{name}_{method}_bytes"] = bench.bytes[method]
    seconds = {method: statistics.median(p["s"] for p in runs[method]) for method in METHODS}
    prefix = "" if name == HEADLINE_SHAPE else f"{name}_"
    for baseline in ("raw_broadcast", "checkpoint", "memory"):
        ratio = seconds["nccl"] / seconds[baseline]
        figures[f"{prefix}nccl_vs_{baseline}_ratio"] = round(ratio, 3)
    return figures


def measure_shape(
    name: str,
    tensors: Tensors,
    hf_config: dict[str, Any],
    source_dir: Path,
    root: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Sync one shape `args.repeats` times by every method, interleaved; its figures."""
    bench = ShapeBench(tensors, hf_config, source_dir, root / f"sync-{name}", args.threads)
    runs: dict[str, list[dict[str, float]]] = {method: [] for method in METHODS}
    rounds = args.warmup + args.repeats
    try:
        for repeat in range(rounds):
            for method in METHODS:
                parts = bench.sync(method, check=repeat == rounds - 1)
                if repeat >= args.warmup:
                    runs[method].append(parts)
    finally:
        bench.close()
    figures = shape_figures(name, bench, runs)
    summary = ", ".join(f"{m} {figures[f'{name}_{m}_s']:.3f} s" for m in METHODS)
    print(f"{name} ({figures[f'{name}_bytes'] / 1e6:.1f} MB): {summary}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds of every method first, per shape"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES)
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="of the weights and the targets",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads in each process"
    )
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    figures: dict[str, Any] = {
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source_dir = demo_model(root)
        for name in shapes:
            if name == "demo":
                tensors = demo_tensors(source_dir, dtype)
                hf_config = json.loads((source_dir / "config.json").read_text())
            else:
                tensors, hf_config = qwen05b_tensors(dtype), qwen05b_config()
            figures.update(measure_shape(name, tensors, hf_config, source_dir, root, args))
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":  # the receiver process is spawned: it imports this module
    main()
