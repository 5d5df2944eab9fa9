#!/usr/bin/env bash
# What only a GPU shows, in one run of a few minutes (not part of CI):
#   bash bench/gpu_checks.sh [--parts ...]
# cuDNN attention against the reference in bf16 and float32, its speed and memory against
# blockwise, a bf16 train step's MFU, the embedded engine's throughput and log-prob gap, and
# the quickstart on the GPU (bench/gpu_checks.py; results in bench/results/gpu_checks.json).
# The trainer's JAX needs its CUDA plugin in .venv: from JAX_CUDA_WHEELS (a directory of
# wheels) or PyPI. On a machine whose own python3 already has JAX with CUDA (and no
# network), run `python3 bench/gpu_checks.py` with longrl's few pure-Python dependencies on
# PYTHONPATH instead, as bench/README.md says.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source bench/jax_cuda.sh
.venv/bin/python bench/gpu_checks.py "$@"
