#!/usr/bin/env bash
# The test suite, slow tests included, on two pytest-xdist workers (most tests are
# single-threaded Python and XLA compiles; tests marked with one xdist_group share a worker,
# and so a module fixture that is costly to make). Extra arguments go to pytest (e.g. -m "not slow"
# to skip the slow ones locally, -n 0 for one process). The set-up makes .venv and, at the same
# time, the real SGLang's environment (.venv-sglang: scripts/setup_sglang.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_sglang.sh &
sglang_setup=$!
bash scripts/setup.sh
wait $sglang_setup || { echo "scripts/setup_sglang.sh failed: the tests need SGLang" >&2; exit 1; }
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=25 "$@"
