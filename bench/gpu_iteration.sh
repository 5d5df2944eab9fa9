#!/usr/bin/env bash
# Whole RL iterations on one GPU with a real SGLang server (not part of CI):
#   bash bench/gpu_iteration.sh [--rounds 3] [--steps 4]
# bench/iteration.py's iteration (8 prompts x 8 samples, up to 256 new tokens, verifier, GRPO
# step, weight sync through the disk) with the trainer (JAX) and an SGLang server sharing the
# GPU: the server takes SERVER_MEM of it (--mem-fraction-static, --enable-memory-saver) and
# JAX TRAINER_MEM (XLA_PYTHON_CLIENT_MEM_FRACTION). Parts ours_sglang (lockstep) and
# ours_sglang_ahead (Ahead.max_staleness = 1: the next step generates while one trains, a
# weight sync lets the requests in flight finish on the old weights) and ours_sglang_hybrid
# (RLConfig.hybrid: the server releases its memory while the trainer trains, the train state
# waits in host memory while the server generates; its switch seconds are printed). The
# trainer keeps its BFC pool here (TRAINER_MEM), so the memory it frees stays in JAX's pool:
# bench/gpu_checks.py --parts hybrid measures what XLA_PYTHON_CLIENT_ALLOCATOR=platform gives
# back. Prints the seconds per
# iteration, its breakdown (generate, verify, score, pack, train, sync | idle of trainer and
# engine) and every weight sync's seconds; bench/results/iteration.json keeps them all.
#
# SGLang comes from SGLANG_PYTHON (default: bench/.venvs/sglang, made here from SGLANG_WHEELS,
# a directory of wheels, or from PyPI), as in bench/gpu_sglang_e2e.sh. The trainer's JAX needs
# its CUDA plugin in .venv: from JAX_CUDA_WHEELS (a directory of wheels) or PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-30124}
SERVER_MEM=${SERVER_MEM:-0.35}
TRAINER_MEM=${TRAINER_MEM:-0.45}
WORK=$(mktemp -d /tmp/longrl-gpu-iteration.XXXXXX)
bash scripts/setup.sh

source bench/jax_cuda.sh
source bench/sglang_python.sh

# The iteration's model at its starting weights, for the server to load (the trainer loads
# the same weights into it again before the first step: remote_engine).
JAX_PLATFORMS=cpu .venv/bin/python -c "import sys; sys.path.insert(0, 'bench')
from iteration import start_model
from models import hf
hf.save(*reversed(start_model()), sys.argv[1])" "$WORK/start"

"$SGLANG_PYTHON" -m sglang.launch_server --model-path "$WORK/start" --skip-tokenizer-init \
  --host 127.0.0.1 --port "$PORT" --weight-version 0 --dtype bfloat16 \
  --mem-fraction-static "$SERVER_MEM" --enable-memory-saver > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then cat "$WORK/server.log"; exit 1; fi
  sleep 1
done
LONGRL_SGLANG_URL="http://127.0.0.1:$PORT" LONGRL_SGLANG_WEIGHTS="$WORK/weights" \
  XLA_PYTHON_CLIENT_MEM_FRACTION="$TRAINER_MEM" \
  .venv/bin/python bench/iteration.py \
  --parts ours_sglang,ours_sglang_ahead,ours_sglang_hybrid "$@"
