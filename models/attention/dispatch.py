"""The one place that chooses an attention kernel.

Owns the kernel names, the per-backend default and the vendor-kernel calls. Model code calls
`attention(q, k, v, segment_ids, kernel=cfg.attention)`; under a mesh with a `context` axis
larger than 1 that is ring attention (ring.py), each device attending key/value chunks with
the C++ kernel where `cpu` runs (explicitly, or `auto` on the CPU backend in float32), with
our Pallas kernel (pallas_gpu.py) for an explicit `pallas_gpu` on a GPU, and with blockwise
tiles otherwise. Without one:

  auto       TPU -> splash, GPU -> cudnn, CPU -> cpu (the only choice that falls back: to
             blockwise when the vendor kernel is missing, or for a dtype it does not take:
             cudnn takes bf16 and f16, cpu float32)
  blockwise  models/attention/blockwise.py (any backend)
  dense      models/attention/reference.py (tests; O(seq^2) memory)
  pallas_gpu JAX's Pallas (Triton) flash attention with segment ids: GPU only, bf16 / f16,
             linear in memory (explicit only until a GPU run of bench/gpu_checks.py has
             measured it against cuDNN)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"); GPU only, bf16 / f16;
             packed rows pass a [seq, seq] mask (memory quadratic in the row)
  splash     Pallas splash attention; TPU only
  cpu        models/attention/cpu.py: C++ kernels through XLA's FFI; CPU only, float32

An explicit choice that cannot run raises. The choice is logged once per (request, backend).

Decode steps (queries against a KV cache) go through `cached_attention`: on CPU the C++ kernel
of models/attention/cpu.py where it builds and takes the arrays (float32), otherwise, and for
`dense`, the reference.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from models.attention import blockwise, cpu, reference, ring

KERNELS = ("auto", "blockwise", "dense", "pallas_gpu", "cudnn", "splash", "cpu")
_DEFAULTS = {"tpu": "splash", "gpu": "cudnn", "cpu": "cpu"}
# The dtypes a vendor kernel takes (cuDNN's fused attention: half precision only), where it
# does not take them all; `auto` runs blockwise for the others.
_DTYPES = {"cpu": (jnp.float32,), "cudnn": (jnp.bfloat16, jnp.float16),
           "pallas_gpu": (jnp.bfloat16, jnp.float16)}
_log = logging.getLogger("longrl.attention")


class KernelUnavailable(RuntimeError):
  """An explicitly requested attention kernel cannot run here."""


def splash_attention(q, k, v, segment_ids, *, interpret: bool = False):
  """Pallas splash attention (TPU; `interpret=True` runs it anywhere, slowly, for tests).

  Same contract as `blockwise.attention`. Each key/value head serves its group of query heads
  through the multi-query kernel, so keys are never repeated. The sequence is padded to the
  kernel's 128-token tiles; padding is segment 0, which splash treats as one more segment, so
  its (discarded) outputs stay finite.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  b, s, h, d = q.shape
  kh = k.shape[2]
  g = h // kh
  tile = 128
  padded = -(-s // tile) * tile
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - s)] + [(0, 0)] * (x.ndim - 2))
  mask = sm.MultiHeadMask([sm.CausalMask((padded, padded)) for _ in range(g)])
  kernel = sk.make_splash_mqa_single_device(mask, interpret=interpret)
  q = pad(q * d ** -0.5).astype(q.dtype).reshape(b, padded, kh, g, d).transpose(0, 2, 3, 1, 4)
  k, v = (pad(x).transpose(0, 2, 1, 3) for x in (k, v))  # [b, kh, s, d]
  seg = pad(segment_ids)

  def one_row(q, k, v, seg):  # q [kh, g, s, d], k/v [kh, s, d], seg [s]
    ids = sk.SegmentIds(q=seg, kv=seg)
    return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

  out = jax.vmap(one_row)(q, k, v, seg)  # [b, kh, g, s, d]
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, d)[:, :s]
  return out * (segment_ids != 0)[:, :, None, None].astype(out.dtype)


def pallas_gpu_attention(q, k, v, segment_ids, *, interpret: bool = False,
                         block: int = 128):
  """JAX's Pallas flash attention for GPUs (jax.experimental.pallas.ops.gpu.attention,
  lowered through Triton; `interpret=True` runs it anywhere, slowly, for tests).

  Same contract as `blockwise.attention`, linear in memory: the kernel reads segment ids
  directly, so packed rows need no [seq, seq] mask, and its backward recomputes the
  probabilities from the saved log-sum-exp. It wants as many key/value heads as query heads:
  each KV head is repeated over its group (the repeat's gradient sums the group back). The
  sequence is padded to the kernel's `block`-token tiles; padding is segment 0, one more
  segment to the kernel, whose outputs are zeroed.
  """
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  b, s, h, d = q.shape
  padded = -(-s // block) * block
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - s)] + [(0, 0)] * (x.ndim - 2))
  group = h // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
  tiles = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)
  out = pallas_attention.mha(pad(q), pad(k), pad(v), pad(segment_ids), sm_scale=d ** -0.5,
                             causal=True, block_sizes=tiles, interpret=interpret)[:, :s]
  return out * (segment_ids != 0)[:, :, None, None].astype(out.dtype)


def cudnn_attention(q, k, v, segment_ids, *, implementation: str = "cudnn"):
  """jax.nn.dot_product_attention with the cuDNN fused kernel (GPU).

  Same contract as `blockwise.attention`; `implementation="xla"` runs the same call anywhere
  (tests). jax.nn.dot_product_attention takes grouped KV heads natively. It has no segment-id
  argument, so packed rows pass a [batch, 1, seq, seq] boolean mask; padding is its own
  segment there (never a fully masked row) and is zeroed afterwards.
  """
  mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                     implementation=implementation)
  return out * (segment_ids != 0)[:, :, None, None].astype(out.dtype)


def _vendor_kernel_available(name: str) -> bool:
  if name == "cpu":
    return jax.default_backend() == "cpu" and cpu.available()
  if name == "splash":
    try:
      from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # noqa: F401
    except ImportError:
      return False
    return jax.default_backend() == "tpu"
  if name == "pallas_gpu":
    if jax.default_backend() != "gpu":
      return False
    try:  # a tiny probe: raises when Triton cannot lower the kernel on this GPU
      with jax.ensure_compile_time_eval():
        x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
        jax.block_until_ready(pallas_gpu_attention(x, x, x, jnp.ones((1, 128), jnp.int32)))
    except Exception:  # noqa: BLE001 - any failure means "cannot run here"
      return False
    return True
  if name == "cudnn":
    if jax.default_backend() != "gpu":
      return False
    try:  # a tiny probe: raises when cuDNN (or a recent enough one) is missing
      with jax.ensure_compile_time_eval():  # run now, even when called while tracing
        x = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
        jax.block_until_ready(jax.nn.dot_product_attention(x, x, x, implementation="cudnn"))
    except Exception:  # noqa: BLE001 - any failure means "cannot run here"
      return False
    return True
  return True


@functools.cache
def _log_once(message: str):
  _log.info(message)


@functools.cache
def resolve(kernel: str, backend: str) -> str:
  """The kernel that runs for request `kernel` on `backend`; raises KernelUnavailable."""
  if kernel not in KERNELS:
    raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
  if kernel == "auto":
    chosen = _DEFAULTS.get(backend, "blockwise")
    if not _vendor_kernel_available(chosen):
      _log.warning("attention: default kernel %r unavailable on %s; using blockwise", chosen,
                   backend)
      chosen = "blockwise"
  else:
    chosen = kernel
    if not _vendor_kernel_available(kernel):
      needs = {"splash": "a TPU", "cudnn": "a GPU with cuDNN",
               "pallas_gpu": "a GPU that Triton lowers Pallas kernels for",
               "cpu": f"the CPU backend and its C++ kernels ({cpu.unavailable_reason()})"}[kernel]
      raise KernelUnavailable(f"attention kernel {kernel!r} needs {needs}; this backend is "
                              f"{backend!r}. Use attention='auto' or 'blockwise'.")
  _log.info("attention: requested %r on %s -> %s", kernel, backend, chosen)
  return chosen


def plan(kernel: str, context: int, dtype=jnp.float32) -> str:
  """What runs for request `kernel` on q, k, v of `dtype` with the sequence split `context`
  ways: the kernel `resolve` picks, except that `auto` runs blockwise where the vendor kernel
  does not take the dtype; with context > 1, "ring/" and the kernel of its chunks. Raises
  KernelUnavailable."""
  if context > 1:
    if kernel not in ("auto", *ring.CHUNK_KERNELS):
      raise KernelUnavailable(f"attention={kernel!r} cannot run context-parallel (context="
                              f"{context}); ring attention folds chunks with "
                              f"{' or '.join(map(repr, ring.CHUNK_KERNELS))}: use one of "
                              "those or 'auto'")
    if kernel == "auto" and jax.default_backend() != "cpu":
      return "ring/blockwise"
    return "ring/" + _single_device(kernel, dtype)
  return _single_device(kernel, dtype)


def _single_device(kernel: str, dtype) -> str:
  chosen = resolve(kernel, jax.default_backend())
  takes = _DTYPES.get(chosen)
  if takes is not None and jnp.dtype(dtype) not in takes:
    names = " or ".join(jnp.dtype(t).name for t in takes)
    if kernel != "auto":
      raise KernelUnavailable(f"attention={chosen!r} takes {names}; this model computes in "
                              f"{jnp.dtype(dtype)}. Use attention='auto' or 'blockwise'.")
    _log_once(f"attention: the {chosen} kernel takes {names}; {jnp.dtype(dtype)} runs "
              "blockwise")
    return "blockwise"
  return chosen


def attention(q, k, v, segment_ids, *, kernel: str = "auto"):
  """Causal attention within segments through the chosen kernel.

  q: [batch, seq, num_heads, head_dim]; k, v: [batch, seq, num_kv_heads, head_dim];
  segment_ids: i32[batch, seq], 0 = padding (zero output). Under a mesh whose `context` axis is
  larger than 1 the rows must be in zigzag order (ring.to_zigzag) and ring attention runs.
  """
  chosen = plan(kernel, ring.context_size(), jnp.result_type(q, k, v))
  if chosen.startswith("ring/"):
    return ring.attention(q, k, v, segment_ids, chunks=chosen.removeprefix("ring/"))
  if chosen == "cpu":
    return cpu.attention(q, k, v, segment_ids)
  if chosen == "blockwise":
    return blockwise.attention(q, k, v, segment_ids)
  if chosen == "dense":
    return reference.attention(q, k, v, reference.segment_causal_mask(segment_ids))
  if chosen == "pallas_gpu":
    return pallas_gpu_attention(q, k, v, segment_ids)
  if chosen == "cudnn":
    return cudnn_attention(q, k, v, segment_ids)
  return splash_attention(q, k, v, segment_ids)


def cached_attention(q, k, v, kv_valid, first_slot, *, kernel: str = "auto"):
  """Queries written at cache slots [first_slot, first_slot + q_len) against the KV cache.

  q: [batch, q_len, num_heads, head_dim]; k, v: [batch, num_kv_heads, cache_len, head_dim];
  kv_valid: bool[batch, cache_len]; first_slot: i32 scalar -> [batch, q_len, num_heads,
  head_dim]. The C++ kernel reads only the slots up to the last query's; the reference reads
  the whole cache.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if (kernel != "dense" and cpu.supports(q, k, v) and (mesh.empty or mesh.size == 1)
      and _vendor_kernel_available("cpu")):
    return cpu.decode_attention(q, k, v, kv_valid, first_slot)
  mask = reference.cache_mask(kv_valid, first_slot, q.shape[1])
  return reference.cached_attention(q, k, v, mask)
