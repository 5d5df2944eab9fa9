#!/usr/bin/env bash
# The quickstart: SFT warm start then Kimi k1.5 RL on synthetic arithmetic, embedded JAX
# engine, CPU. Extra arguments go to experiments/run.py (e.g. --run_dir, --gin_param).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python experiments/run.py --gin experiments/configs/quickstart.gin "$@"
