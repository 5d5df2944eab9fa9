#!/usr/bin/env bash
# K LoRA arms in one run against K runs one after another, on one GPU (not part of CI):
#   bash bench/gpu_arms.sh [--arms 4] [--rounds 3] [--block 3]
# bench/lora_arms.py on the GPU (results in bench/results/gpu/lora_arms.json). On a 2-core CPU
# the arms' vmapped update is compute-bound and gains nothing; a GPU that one arm's quickstart
# step leaves mostly idle is where sharing one program over K arms should show.
# The trainer's JAX needs its CUDA plugin in .venv: from JAX_CUDA_WHEELS (a directory of
# wheels) or PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source bench/jax_cuda.sh
.venv/bin/python bench/lora_arms.py --out bench/results/gpu "$@"
