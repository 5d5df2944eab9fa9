# Sourced by the GPU scripts: sets SGLANG_PYTHON, an interpreter that can `import sglang`.
# Given one, it is kept; else bench/.venvs/sglang is made (once) and sglang==SGLANG_VERSION
# installed into it from SGLANG_WHEELS (a directory of wheels, for machines without network)
# or from PyPI.
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
if [ -z "${SGLANG_PYTHON:-}" ]; then
  if [ ! -x bench/.venvs/sglang/bin/python ]; then
    python3 -m venv bench/.venvs/sglang
    if [ -n "${SGLANG_WHEELS:-}" ]; then
      bench/.venvs/sglang/bin/pip install --no-index --find-links "$SGLANG_WHEELS" \
        "sglang==$SGLANG_VERSION"
    else
      bench/.venvs/sglang/bin/pip install "sglang==$SGLANG_VERSION"
    fi
  fi
  SGLANG_PYTHON=bench/.venvs/sglang/bin/python
fi
