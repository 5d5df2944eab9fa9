#!/usr/bin/env bash
# The test suite, slow tests included. Extra arguments go to pytest
# (e.g. -m "not slow" to skip the slow ones locally).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
