"""keep_freed_memory: XLA:CPU's per-run temporary buffer is reused, not page-faulted in anew."""

import json
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process each: the setting has to come before JAX starts its CPU backend.
_PROGRAM = """
import json, resource, sys
if sys.argv[1] == "keep":
  from models import host_allocator
  assert host_allocator.keep_freed_memory()
import jax, jax.numpy as jnp
x, w = jnp.ones((2048, 512)), jnp.full((512, 8192), 1e-3)
run = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T).lower(x, w).compile()
temp = run.memory_analysis().temp_size_in_bytes  # the [2048, 8192] intermediate
faults = []
for _ in range(20):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  run(x, w).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The median of the last ten: the heap settles over the first runs, after which a run now and
# then still grows it a little.
faults = sorted(faults[10:])[5]
print(json.dumps({"temp_pages": temp / resource.getpagesize(), "faults_per_run": faults}))
"""


def _faults(setting):
  out = subprocess.run([sys.executable, "-c", _PROGRAM, setting], cwd=ROOT, check=True,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
  return json.loads(out.stdout.strip().splitlines()[-1])


# CI and this project's machines run glibc, so CI runs it; elsewhere keep_freed_memory does
# nothing (the test below), and there is no setting to measure.
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="keep_freed_memory sets glibc's malloc; off glibc it is a no-op")
def test_temporary_buffer_is_reused_instead_of_faulted_in_each_run():
  default, keep = _faults("default"), _faults("keep")
  assert default["temp_pages"] >= 16384  # 64 MiB: above what a thread's own arena serves
  # By default every run faults the whole intermediate in again; kept, it is reused.
  assert default["faults_per_run"] > 0.5 * default["temp_pages"], default
  assert keep["faults_per_run"] < 0.05 * keep["temp_pages"], keep


def test_keep_freed_memory_is_a_no_op_off_glibc(monkeypatch):
  from models import host_allocator
  monkeypatch.setattr(platform, "system", lambda: "Darwin")
  assert host_allocator.keep_freed_memory() is False
