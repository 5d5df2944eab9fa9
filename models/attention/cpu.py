"""Attention kernels in C++ for XLA:CPU (cpu_attention.cc), called through XLA's FFI.

Owns building the kernels, registering them with XLA and their JAX-side calls. The C++ source
is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`), for this CPU
(-march=native), and cached under `$LONGRL_CACHE` (default ~/.cache/longrl; the temporary
directory where that cannot be made), keyed by the source, the compiler, the XLA FFI headers
and the CPU, so a later process loads it at once.
Where no compiler is found or the build fails, `available()` is False and `unavailable_reason()`
says why; models/attention/dispatch.py then uses the XLA kernels.

What is here:
- `attention`: causal attention within segments for training (the contract of
  blockwise.attention), flash-style with a recomputing backward pass. Each work item takes all
  query heads of one KV head over a block of positions, so a key block is read once for the
  group, and the scores of a block pair stay in the core's cache; XLA's blockwise kernel
  materialises every tile's scores for the whole batch and all heads.
- `chunk_forward`, `chunk_backward`: the same kernels on queries against one key/value chunk,
  with the two sides' segment ids and causal positions given apart, returning the chunk's
  log-sum-exp: what ring attention (ring.py) folds the chunks arriving from other devices with.
- `decode_attention`: queries against a KV cache (the embedded engine's decode steps). It reads
  only the cache slots a query can see; XLA's dense form reads the whole cache, and on a 2-core
  CPU that took a fifth of a decode step of bench/peers.py's model.
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
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import sharding

SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
TARGETS = {"longrl_decode_attention": "LongrlDecodeAttention",  # FFI name -> C symbol
           "longrl_flash_forward": "LongrlFlashForward",
           "longrl_flash_backward": "LongrlFlashBackward"}
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
  name = f"cpu_attention-{key.hexdigest()[:16]}.so"
  out = cache_dir() / name
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
  except OSError:  # a read-only home (some CI runners): build for this machine's session only
    out = pathlib.Path(tempfile.gettempdir(), f"longrl-{os.getuid()}", name)
    out.parent.mkdir(parents=True, exist_ok=True)
  if out.exists():
    return out
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


_loading = threading.Lock()


def _load() -> str | None:
  """Build, load and register the kernels once per process; the reason they are unavailable,
  or None."""
  with _loading:  # the first calls may come from several threads (the server's, a notebook's)
    return _load_once()


@functools.cache
def _load_once() -> str | None:
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
  return _call("longrl_decode_attention", jax.ShapeDtypeStruct(q.shape, q.dtype), q, k, v,
               kv_valid.astype(bool), jnp.asarray(first_slot, jnp.int32))


def _call(name, results, *args):
  if not available():
    raise RuntimeError(f"C++ CPU attention kernels unavailable: {unavailable_reason()}")
  return jax.ffi.ffi_call(name, results, vmap_method="sequential")(*args)


def chunk_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """The kernel's forward: q (scaled) f32[b, sq, h, d] against k, v f32[b, sk, kh, d], with
  q_seg i32[b, sq], q_pos i32[sq], kv_seg i32[b, sk], kv_pos i32[sk] (query i sees key j iff
  kv_pos[j] <= q_pos[i] in the same nonzero segment) -> (out f32[b, sq, h, d], lse f32[b, sq, h],
  +inf where a query sees no key)."""
  b, s, h, _ = q.shape
  return _call("longrl_flash_forward", (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                        jax.ShapeDtypeStruct((b, s, h), jnp.float32)),
               q, k, v, q_seg, q_pos, kv_seg, kv_pos)


def chunk_backward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, lse, delta, dout):
  """-> (dq, dk, dv) f32 of `chunk_forward`'s arguments, from the log-sum-exp and delta =
  sum(dout * out, -1), both f32[b, sq, h], of the whole attention (all key chunks)."""
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  return _call("longrl_flash_backward", shapes, q, k, v, q_seg, q_pos, kv_seg, kv_pos, lse,
               delta, dout.astype(jnp.float32))


@jax.custom_vjp
def _flash(q, k, v, segment_ids):
  return _flash_fwd(q, k, v, segment_ids)[0]


def _flash_fwd(q, k, v, segment_ids):
  positions = jnp.arange(q.shape[1], dtype=jnp.int32)
  out, lse = chunk_forward(q, k, v, segment_ids, positions, segment_ids, positions)
  return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(residuals, dout):
  q, k, v, segment_ids, out, lse = residuals
  positions = jnp.arange(q.shape[1], dtype=jnp.int32)
  delta = jnp.sum(dout.astype(jnp.float32) * out, axis=-1)
  dq, dk, dv = chunk_backward(q, k, v, segment_ids, positions, segment_ids, positions, lse,
                              delta, dout)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(q, k, v, segment_ids):
  """Causal attention within segments: query i sees key j iff j <= i and both are in the same
  segment (segment 0 = padding, whose output is zero). The contract of blockwise.attention.

  q: f32[batch, seq, num_heads, head_dim]; k, v: f32[batch, seq, num_kv_heads, head_dim];
  segment_ids: i32[batch, seq] -> f32[batch, seq, num_heads, head_dim]. Memory is linear in
  seq: the backward pass keeps (q, k, v, out, logsumexp) and recomputes the probabilities.

  Under a mesh set with `jax.set_mesh`, each device runs the kernel on its own rows and heads
  (split as models/sharding.py's rules say; query heads follow their KV heads): XLA cannot
  partition a foreign call, and would gather the whole batch onto every device.
  """
  local = lambda q, k, v, seg: _flash(q * q.shape[-1] ** -0.5, k, v, seg.astype(jnp.int32))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return local(q, k, v, segment_ids)
  qkv = sharding.spec((sharding.BATCH, sharding.SEQ, sharding.ACT_KV_HEADS, None), k.shape, mesh)
  if qkv[1] is not None:
    raise ValueError("cpu.attention splits no sequence; ring attention does (a `context` axis)")
  seg = P(qkv[0], None)
  return jax.shard_map(local, in_specs=(qkv, qkv, qkv, seg), out_specs=qkv,
                       check_vma=False)(q, k, v, segment_ids)
