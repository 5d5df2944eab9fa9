#!/usr/bin/env bash
# The real SGLang server the tests run against (tests/real_sglang.py): sglang==0.5.23 from the
# package registry in a virtual environment of its own, .venv-sglang (longrl never imports
# sglang). Idempotent; about 4 minutes and 9 GB the first time: sglang pins the registry's
# CUDA build of torch. On this CPU it runs with SGLANG_USE_CPU_ENGINE=1 and --device cpu, and
# two things replace what only CUDA machines have:
# - sglang-kernel is uninstalled: its sgl_kernel is CUDA-only, and SGLang's CPU path imports
#   a CPU build of it that the registry does not have;
# - tests/sglang_cpu/sgl_kernel.py, ours, is put on the environment's path in its place: the
#   nine names SGLang imports at start-up on a CPU, each raising if it is ever called.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
VENV=${LONGRL_SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
stamp=$VENV/.longrl-sglang-$SGLANG_VERSION
if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "sglang==$SGLANG_VERSION"
  "$VENV/bin/python" -m pip uninstall --quiet -y sglang-kernel
  touch "$stamp"
fi
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/tests/sglang_cpu" > "$site/longrl_sgl_kernel_standin.pth"
