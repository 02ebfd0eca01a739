#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): a Qwen2-0.5B-shaped model trained by the
# Megatron engine in bf16 (tokens/s, MFU), fp32 CPU/GPU parity of the tiny test model, a full
# checkpoint save + load and an HF weights export, timed, then a collective weight sync of its
# weights to a receiver process (NCCL with two GPUs, gloo with one or none: seconds and GB/s
# against a raw broadcast, bit-identical, a damaged bucket refused); one JSON line last on stdout.
#
#   bash scripts/gpu_check.sh --prepare        # where pip can download: the Python 3.12
#                                              # wheels the engine needs, into .whl/ (~7 MiB)
#   bash scripts/gpu_check.sh [--out FILE]     # on the GPU machine, from the repo root
#   bash scripts/gpu_check.sh --dry-run        # on CPU: tiny model, same code path (tests)
#
# The GPU machine needs Python 3.12 with torch (CUDA), transformers and safetensors; no
# network. If megatron-core is missing there, the wheels in .whl/ (git-ignored: carry it to
# that machine) are installed with `pip --no-index` into .whl/site, which goes first on
# PYTHONPATH. The engine imports neither dagster nor deltalake, so neither is carried. The weight
# sync receiver's imports reach the service's HTTP client (httpx, not carried): the check puts
# an empty stand-in module in its place where httpx is missing (it never makes a request).
# Other options (--seq, --batch, --micro-batch, --steps, --syncs, --workdir) go to the Python
# check.
set -euo pipefail
cd "$(dirname "$0")/.."

# megatron-core and what the engine's import chain needs beyond torch/numpy/transformers
# (pydantic and PyYAML for the config, psutil for dist_checkpointing), pinned together.
WHEELS=(
  megatron-core==0.16.1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  packaging==26.4
  pyyaml==6.0.4
  psutil==7.2.2
)

if [[ "${1:-}" == "--prepare" ]]; then
  PIP="${PIP:-.venv/bin/pip}"
  rm -rf .whl
  "$PIP" download --python-version 3.12 --only-binary=:all: --no-deps "${WHEELS[@]}" -d .whl
  du -sh .whl
  exit 0
fi

if [[ -x .venv/bin/python ]]; then
  PY="${PYTHON:-.venv/bin/python}"
else
  PY="${PYTHON:-python3}"
fi
if [[ -d .whl/site ]]; then
  export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import megatron.core, pydantic, yaml, psutil" 2>/dev/null; then
  if [[ ! -d .whl ]]; then
    echo "gpu_check: megatron-core is not importable and there is no .whl/;" \
      "run 'bash scripts/gpu_check.sh --prepare' where pip can download, and bring .whl/" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --find-links .whl --no-deps --target .whl/site \
    "${WHEELS[@]}"
  export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# cuBLAS needs a fixed workspace for the deterministic algorithms the engine asks for.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
exec "$PY" -m benchmarks.gpu_check "$@"
