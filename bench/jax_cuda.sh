# Sourced by the GPU scripts: gives .venv's JAX its CUDA plugin unless it already sees a GPU,
# from JAX_CUDA_WHEELS (a directory of wheels, for machines without network) or PyPI.
if ! .venv/bin/python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  if [ -n "${JAX_CUDA_WHEELS:-}" ]; then
    .venv/bin/pip install -q --no-index --find-links "$JAX_CUDA_WHEELS" "jax[cuda12]"
  else
    .venv/bin/pip install -q "jax[cuda12]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
  fi
fi
