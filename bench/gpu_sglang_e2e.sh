#!/usr/bin/env bash
# End-to-end checks of the SGLang path on a GPU machine (not part of CI):
#   bash bench/gpu_sglang_e2e.sh
# Writes a tiny random Qwen2 checkpoint, starts a real SGLang server on it, and runs the
# contract, log-prob parity, refit, teacher scoring, partial rollout (aborts by rid) and hybrid
# release/resume checks, then generation and a refit through the real sglang-router
# (bench/gpu_sglang_checks.py). Then quantized refits: a server started from the FP8 export
# refit with another FP8 export, and one from the INT4 export refit with another INT4 export
# (bench/gpu_sglang_checks.py --refit: FP8 must refit, INT4 is expected to take the server
# down, which rollouts/sglang_engine.py refuses ahead of a run; a server that survives it fails the
# check, so that the refusal is lifted). Then a LoRA run's syncs on a server started with
# --enable-lora (bench/gpu_sglang_checks.py --lora: the base, then each version's adapter under
# its own name, served as the merged weights; an adapter sync against a full sync, timed).
# --enable-memory-saver needs torch_memory_saver, which SGLang's
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
    for fmt in ("fp8", "int4"):
      hf.save(params, cfg, f"{sys.argv[1]}/{fmt}/v{version:06d}", quantization=fmt)
PY

# serve DIR [FLAGS...]: a server on DIR in the background (SERVER its pid), up.
serve() {
  local dir=$1
  shift
  "$SGLANG_PYTHON" -m sglang.launch_server --model-path "$dir" --skip-tokenizer-init \
    --host 127.0.0.1 --port "$PORT" --weight-version 0 --dtype bfloat16 \
    --mem-fraction-static 0.2 --disable-cuda-graph "$@" > "$WORK/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then return 0; fi
    if ! kill -0 $SERVER 2>/dev/null; then cat "$WORK/server.log"; return 1; fi
    sleep 1
  done
  return 1
}
trap 'kill $SERVER 2>/dev/null || true' EXIT
status=0
serve "$WORK/v000000" --enable-memory-saver
.venv/bin/python bench/gpu_sglang_checks.py "http://127.0.0.1:$PORT" "$WORK" "$API_TYPES" \
  || status=1
for fmt in fp8 int4; do
  kill $SERVER 2>/dev/null || true
  wait $SERVER 2>/dev/null || true
  serve "$WORK/$fmt/v000000" || { echo "FAIL $fmt: the server did not start"; status=1; continue; }
  .venv/bin/python bench/gpu_sglang_checks.py --refit "$fmt" "http://127.0.0.1:$PORT" \
    "$WORK/$fmt" || status=1
  tail -n 20 "$WORK/server.log"
done
kill $SERVER 2>/dev/null || true
wait $SERVER 2>/dev/null || true
MAX_RANK=$(.venv/bin/python -c "from rollouts.sglang_engine import LORA_MAX_RANK; print(LORA_MAX_RANK)")
if serve "$WORK/v000000" --enable-lora --max-lora-rank "$MAX_RANK" --lora-target-modules all; then
  .venv/bin/python bench/gpu_sglang_checks.py --lora "http://127.0.0.1:$PORT" "$WORK" || status=1
  tail -n 20 "$WORK/server.log"
else
  echo "FAIL lora: the server did not start"; status=1
fi
exit $status
