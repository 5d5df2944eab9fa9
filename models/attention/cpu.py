"""Attention kernels in C++ for XLA:CPU (cpu_attention.cc), called through XLA's FFI.

Owns building the kernels, registering them with XLA and their JAX-side calls. The C++ source
is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`), for this CPU
(-march=native), and cached under `$LONGRL_CACHE` (default ~/.cache/longrl), keyed by the
source, the compiler, the XLA FFI headers and the CPU, so a later process loads it at once.
Where no compiler is found or the build fails, `available()` is False and `unavailable_reason()`
says why; models/attention/dispatch.py then uses the XLA kernels.

What is here: `decode_attention`, queries against a KV cache (the embedded engine's decode
steps). It reads only the cache slots a query can see; XLA's dense form reads the whole cache,
and on a 2-core CPU that took a fifth of a decode step of bench/peers.py's model.
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
TARGETS = {"longrl_decode_attention": "LongrlDecodeAttention"}  # FFI name -> C symbol
_log = logging.getLogger("longrl.attention")


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("LONGRL_CACHE", pathlib.Path.home() / ".cache" / "longrl"))


def _cpu_signature() -> str:
  """What -march=native compiles for: the CPU's model and feature flags where Linux says."""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() or platform.machine()
  keep = [line for line in info.splitlines()[:40] if line.startswith(("model name", "flags"))]
  return "\n".join(keep) or platform.machine()


def _compiler():
  compiler = shutil.which(os.environ.get("CXX", "c++"))
  if compiler is None:
    raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} is not on PATH "
                       "(set CXX, or install g++)")
  return compiler


def _build() -> pathlib.Path:
  """The compiled library, built now unless the cache has it. Raises RuntimeError."""
  compiler = _compiler()
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  include = jax.ffi.include_dir()
  key = hashlib.sha256()
  for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(),
               pathlib.Path(include, "xla", "ffi", "api", "c_api.h").read_bytes(),
               _cpu_signature().encode()):
    key.update(part)
  out = cache_dir() / f"cpu_attention-{key.hexdigest()[:16]}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Built under a temporary name and renamed, so that processes building at once (test
  # workers) never load a half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    result = subprocess.run([compiler, *FLAGS, "-isystem", include, str(SOURCE), "-o", tmp],
                            capture_output=True, text=True)
    if result.returncode:
      raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr[:2000]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return out


@functools.cache
def _load() -> str | None:
  """Build, load and register the kernels once per process; the reason they are unavailable,
  or None."""
  try:
    library = ctypes.CDLL(str(_build()))
    for name, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, AttributeError) as error:
    _log.warning("attention: C++ CPU kernels unavailable: %s", error)
    return str(error)
  return None


def available() -> bool:
  """Whether the kernels are built and registered (building them now if need be)."""
  return _load() is None


def unavailable_reason() -> str | None:
  return _load()


def supports(*arrays) -> bool:
  """Whether the kernels take these q/k/v arrays: float32 (any head_dim)."""
  return all(x.dtype == jnp.float32 for x in arrays)


def decode_attention(q, k, v, kv_valid, first_slot):
  """Queries written at cache slots [first_slot, first_slot + q_len) against the cache.

  q: f32[batch, q_len, num_heads, head_dim]; k, v: f32[batch, num_kv_heads, cache_len,
  head_dim]; kv_valid: bool[batch, cache_len]; first_slot: i32 scalar (may be traced).
  Query t sees slot j iff kv_valid[j] and j <= first_slot + t (reference.cache_mask); a query
  that sees none outputs zeros. -> f32[batch, q_len, num_heads, head_dim].
  """
  if not available():
    raise RuntimeError(f"C++ CPU attention kernels unavailable: {unavailable_reason()}")
  call = jax.ffi.ffi_call("longrl_decode_attention", jax.ShapeDtypeStruct(q.shape, q.dtype),
                          vmap_method="sequential")
  return call(q, k, v, kv_valid.astype(bool), jnp.asarray(first_slot, jnp.int32))
