"""Ring attention: causal attention with the sequence sharded over the mesh axis `context`.

Owns the zigzag layout and the ring. Each device keeps its query chunk and passes its key/value
chunk (with segment ids and causal indices) around the ring with `ppermute`, folding each
arriving chunk into its online softmax with one kernel's chunk functions: blockwise.py's tiles
(any backend), or a fused kernel that takes the two sides' segment ids and positions apart and
returns each chunk's log-sum-exp, the chunks merged by log-sum-exp weights (`FusedChunks`): the
C++ kernel on CPU (cpu.py), our Pallas kernel on GPUs (pallas_gpu.py); the next chunk's
transfer is issued before the current chunk's compute so that XLA can overlap them. The custom
VJP sends key/value chunks around again, together with their gradient accumulators, which arrive
back at their owner after a full turn. Per-device memory is that of one chunk.

Zigzag layout (Brandon et al. 2023, "Striped attention"; the zigzag variant of Megatron-CP): the
sequence is cut into 2 x context chunks and device r holds chunks r and 2 x context - 1 - r, so
under a causal mask every device has the same number of visible (query, key) pairs. Model code
puts its rows in this order once per forward (`to_zigzag`) and back at the end (`from_zigzag`);
everything but attention is position-wise, and RoPE reads explicit positions.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import sharding
from typing import Callable, NamedTuple

from models.attention import blockwise, cpu, pallas_gpu

CONTEXT_AXIS = "context"


class FusedChunks(NamedTuple):
  """The ring's chunk functions over a fused kernel's `forward(q, k, v, q_seg, q_pos, kv_seg,
  kv_pos) -> (out, lse)` and `backward(..., lse, delta, dout) -> (dq, dk, dv)` (cpu.py's
  contract: rows [b, s, heads, d], lse and delta [b, s, heads], lse = +inf where a query saw
  nothing). The state is (out f32, lse f32), lse -inf until a key is seen; a side's meta is
  (segment ids i32[b, s], causal positions i32[s])."""
  forward: Callable
  backward: Callable

  def init_state(self, q):
    return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)

  def attend_chunk(self, state, q, q_meta, k, v, kv_meta):
    """Fold one key/value chunk into the running (out, lse): the kernel's result for the
    chunk, merged by log-sum-exp weights."""
    out, lse = state
    chunk_out, chunk_lse = self.forward(q, k, v, *q_meta, *kv_meta)
    chunk_lse = jnp.where(jnp.isposinf(chunk_lse), -jnp.inf, chunk_lse)
    merged = jnp.logaddexp(lse, chunk_lse)
    safe = jnp.where(jnp.isneginf(merged), 0.0, merged)  # no key yet on either side
    weight = lambda x: jnp.exp(x - safe)[..., None]
    return out * weight(lse) + chunk_out * weight(chunk_lse), merged

  def finalize(self, state):
    """-> (out, lse), lse = +inf where no key was seen (the kernels' backward convention)."""
    out, lse = state
    return out, jnp.where(jnp.isneginf(lse), jnp.inf, lse)

  def zero_grads(self, q, k, v):
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

  def grad_chunk(self, grads, q, q_meta, dout, lse, delta, k, v, kv_meta):
    """Add one key/value chunk's share of (dq, dk, dv) to `grads`."""
    share = self.backward(q, k, v, *q_meta, *kv_meta, lse, delta, dout)
    return tuple(g + x for g, x in zip(grads, share))


# What the ring folds chunks with: blockwise.py's tiles or a fused kernel, by kernel name.
CHUNK_KERNELS = {"blockwise": blockwise,
                 "cpu": FusedChunks(cpu.chunk_forward, cpu.chunk_backward),
                 "pallas_gpu": FusedChunks(pallas_gpu.chunk_forward, pallas_gpu.chunk_backward)}


def zigzag_order(seq: int, context: int) -> np.ndarray:
  """i32[seq]: slot p of the zigzag layout holds original position order[p].

  seq must be a multiple of 2 x context (callers pad).
  """
  if seq % (2 * context):
    raise ValueError(f"zigzag layout needs a sequence length divisible by 2 x context = "
                     f"{2 * context}, got {seq}")
  chunks = np.arange(seq, dtype=np.int32).reshape(2 * context, -1)
  return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]])
                         for r in range(context)])


def padded_length(seq: int, context: int) -> int:
  return -(-seq // (2 * context)) * (2 * context)


def to_zigzag(x, context: int):
  """Pad axis 1 to a multiple of 2 x context (with zeros: segment 0 = padding) and reorder."""
  seq = x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, padded_length(seq, context) - seq)] + [(0, 0)] * (x.ndim - 2))
  return x[:, zigzag_order(x.shape[1], context)]


def from_zigzag(x, seq: int, context: int):
  """Inverse of `to_zigzag`: original order, padding dropped."""
  inverse = np.argsort(zigzag_order(x.shape[1], context))
  return x[:, inverse][:, :seq]


def context_size(mesh=None) -> int:
  """Size of the `context` axis of `mesh` (default: the mesh set with jax.set_mesh); 1 if none."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[CONTEXT_AXIS]


def _ring_specs(mesh, kv_shape):
  """(q/k/v, segment ids, causal index) specs from models/sharding.py's rules. Query heads
  follow the KV heads' split, so each device keeps whole groups."""
  kv = sharding.spec((sharding.BATCH, sharding.SEQ, sharding.ACT_KV_HEADS, None), kv_shape, mesh)
  return kv, P(kv[0], kv[1]), P(kv[1])


def _shift(tree, axis, size):
  """Send every device's `tree` to the next device on the ring."""
  perm = [(r, (r + 1) % size) for r in range(size)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _turn(carry, chunk, visit, axis: str, size: int):
  """`carry = visit(carry, c)` for the local chunk, then for each chunk arriving round the ring.

  Each send is issued before the visit it overlaps with. A loop, not unrolled, so that one
  step's buffers are reused by the next; the last visit is peeled off (nothing to send on).
  """
  def step(state, _):
    carry, chunk = state
    incoming = _shift(chunk, axis, size)
    return (visit(carry, chunk), incoming), None

  (carry, chunk), _ = jax.lax.scan(step, (carry, chunk), length=size - 1)
  return visit(carry, chunk)


def _make_ring(axis: str, size: int, tiles):
  """The custom-VJP ring over a chunk kernel's functions `tiles` (runs inside shard_map)."""

  @jax.custom_vjp
  def ring(q, k, v, q_meta, kv_meta):
    return ring_fwd(q, k, v, q_meta, kv_meta)[0]

  def ring_fwd(q, k, v, q_meta, kv_meta):
    visit = lambda state, chunk: tiles.attend_chunk(state, q, q_meta, *chunk)
    state = _turn(tiles.init_state(q), (k, v, kv_meta), visit, axis, size)
    out, lse = tiles.finalize(state)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_meta, kv_meta, out, lse)

  def ring_bwd(residuals, dout):
    q, k, v, q_meta, kv_meta, out, lse = residuals
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def visit(grads, chunk):
      dq, dk, dv = tiles.grad_chunk(grads, q, q_meta, dout, lse, delta, *chunk)
      # dk, dv accumulate in place and travel with their chunk; after `size` shifts they are
      # back with the chunk's owner.
      return (dq, *_shift((dk, dv), axis, size))

    dq, dk, dv = _turn(tiles.zero_grads(q, k, v), (k, v, kv_meta), visit, axis, size)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None

  ring.defvjp(ring_fwd, ring_bwd)
  return ring


def attention(q, k, v, segment_ids, *, chunks: str = "blockwise",
              block_q: int = blockwise.DEFAULT_BLOCK, block_k: int = blockwise.DEFAULT_BLOCK):
  """Causal attention within segments over rows in zigzag order, sharded over `context`.

  `chunks` names the kernel each device attends a key/value chunk with: "blockwise" (tiles of
  block_q x block_k), "cpu" (the C++ kernel; float32 on the CPU backend) or "pallas_gpu" (ours;
  bf16 / f16 on GPUs, Pallas interpret mode elsewhere).

  Runs under the mesh set with `jax.set_mesh`; batch and heads are split as
  models/sharding.py's rules say (data/fsdp, tensor) where the sizes divide. Shapes are global:
    q: [batch, seq, num_heads, head_dim]; k, v: [batch, seq, num_kv_heads, head_dim];
    segment_ids: i32[batch, seq] (0 = padding), all in `to_zigzag` order, seq divisible by
    2 x context.
  Returns [batch, seq, num_heads, head_dim] in zigzag order.
  """
  mesh = jax.sharding.get_abstract_mesh()
  size = context_size(mesh)
  b, s, h, d = q.shape
  qkv_spec, seg_spec, idx_spec = _ring_specs(mesh, k.shape)
  ring = _make_ring(CONTEXT_AXIS, size, CHUNK_KERNELS[chunks])
  local = s // size

  def per_device_fused(q, k, v, seg, index):
    meta = (seg.astype(jnp.int32), index)
    return ring((q * d ** -0.5).astype(q.dtype), k, v, meta, meta)

  def per_device(q, k, v, seg, index):
    bq, bk = blockwise.block_size(local, block_q), blockwise.block_size(local, block_k)
    lb, _, lh, _ = q.shape
    scaled = (q * d ** -0.5).astype(q.dtype).reshape(lb, local, k.shape[2], lh // k.shape[2], d)
    out = ring(blockwise.to_q_blocks(scaled, bq), blockwise.to_kv_blocks(k, bk),
               blockwise.to_kv_blocks(v, bk), blockwise.to_meta(seg, index, bq),
               blockwise.to_meta(seg, index, bk))
    return blockwise.from_q_blocks(out, local)

  index = jnp.asarray(zigzag_order(s, size))
  return jax.shard_map(per_device if chunks == "blockwise" else per_device_fused,
                       in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec, idx_spec),
                       out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids, index)
