#!/usr/bin/env bash
# End-to-end checks of the SGLang path on a GPU machine (not part of CI):
#   bash bench/gpu_sglang_e2e.sh
# Writes a tiny random Qwen2 checkpoint, starts a real SGLang server on it, and runs the
# contract, log-prob parity, refit, teacher scoring, partial rollout (aborts by rid) and hybrid
# release/resume checks, then generation and a refit through the real sglang-router
# (bench/gpu_sglang_checks.py). --enable-memory-saver needs torch_memory_saver, which SGLang's
# own dependencies install.
#
# SGLang comes from SGLANG_PYTHON (an interpreter that can `import sglang`, default: a venv
# made here in bench/.venvs/sglang) installed from SGLANG_WHEELS (a directory of wheels, for
# machines without network) or from PyPI. longrl's own checks run in .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-30123}
WORK=$(mktemp -d /tmp/longrl-sglang-e2e.XXXXXX)
bash scripts/setup.sh

source bench/sglang_python.sh
API_TYPES=$("$SGLANG_PYTHON" -c "import sglang, os; print(os.path.join(os.path.dirname(sglang.__file__), 'api', 'v1', 'api_types.py'))")

# Two tiny random Qwen2 checkpoints in bf16 (v0 served first, v1 for the refit): what a run
# exports, and what SGLang's default attention on Hopper (FA3) takes (not float32).
.venv/bin/python - "$WORK" <<'PY'
import dataclasses, sys, jax
from models import config, hf, transformer
cfg = config.tiny(512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128)
cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
for version in (0, 1):
    params = transformer.init_params(cfg, jax.random.PRNGKey(version))
    hf.save(params, cfg, f"{sys.argv[1]}/v{version:06d}")
PY

"$SGLANG_PYTHON" -m sglang.launch_server --model-path "$WORK/v000000" --skip-tokenizer-init \
  --host 127.0.0.1 --port "$PORT" --weight-version 0 --dtype bfloat16 \
  --mem-fraction-static 0.2 --disable-cuda-graph --enable-memory-saver \
  > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then cat "$WORK/server.log"; exit 1; fi
  sleep 1
done
.venv/bin/python bench/gpu_sglang_checks.py "http://127.0.0.1:$PORT" "$WORK" "$API_TYPES"
