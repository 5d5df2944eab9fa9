"""Our Pallas flash attention for GPUs (lowered through Triton): the kernel ring attention folds
key/value chunks with on GPUs.

Owns the chunk kernel's forward and backward. JAX's Pallas GPU kernel (dispatch.py
`pallas_gpu_attention`, single-device attention) takes one segment-id array for queries and keys
and returns no log-sum-exp one may merge by, so a device cannot attend another device's chunk
with it. This one has the contract of the C++ kernel's chunks (cpu.py `chunk_forward`): queries
against a key/value chunk, each side with its own segment ids and causal positions, returning
(out, lse); its backward takes the lse and delta of the whole attention, so each chunk's call
gives its share of the gradients. Off a GPU it runs in Pallas interpret mode (tests).

Programs: the forward and dq run one per (query tile, row, query head) and loop over key tiles;
dk, dv one per (key tile, row, query head), looping over query tiles, and a query head's
gradients are summed over its group afterwards. A tile pair that no query can see causally
(the least key position after the greatest query position) is skipped at run time (`lax.cond`):
under the zigzag layout that is half of each ring step's pairs. Head dims are padded to a power
of two and lengths to the tiles (Triton's block shapes); padding is segment 0, never seen.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TILE = 64  # query and key positions per tile (Triton's dot needs at least 16)
_FAR = jnp.iinfo(jnp.int32).max  # the position of padded keys: after every query


def _mask(q_seg, q_pos, kv_seg, kv_pos):
  """bool[tq, tk]: query t sees key j (same nonzero segment, not later)."""
  return ((q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] != 0)
          & (kv_pos[None, :] <= q_pos[:, None]))


def _some_causally_visible(q_pos, kv_pos):
  return jnp.min(kv_pos) <= jnp.max(q_pos)


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref,
                    out_ref, lse_ref):
  """One query tile of one head against its KV head's whole chunk.

  q_ref: [tq, d]; k_ref, v_ref: [sk, d]; q_seg_ref, q_pos_ref: [tq]; kv_seg_ref, kv_pos_ref:
  [sk] -> out_ref [tq, d], lse_ref [tq] (+inf where no key is seen)."""
  tq, d = q_ref.shape
  q, q_seg, q_pos = q_ref[...], q_seg_ref[...], q_pos_ref[...]

  def visit(j, carry):
    at = pl.ds(j * TILE, TILE)
    kv_seg, kv_pos = kv_seg_ref[at], kv_pos_ref[at]

    def update(carry):
      acc, m, l = carry
      s = plgpu.dot(q, k_ref[at, :], trans_b=True).astype(jnp.float32)
      s = jnp.where(_mask(q_seg, q_pos, kv_seg, kv_pos), s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: no inf - inf
      p = jnp.exp(s - m_safe[:, None])
      correction = jnp.exp(m - m_safe)
      v = v_ref[at, :]
      acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
      return acc, m_new, l * correction + jnp.sum(p, axis=1)

    return jax.lax.cond(_some_causally_visible(q_pos, kv_pos), update, lambda c: c, carry)

  init = (jnp.zeros((tq, d), jnp.float32), jnp.full((tq,), -jnp.inf, jnp.float32),
          jnp.zeros((tq,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, k_ref.shape[0] // TILE, visit, init)
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  out_ref[...] = (acc / l_safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)


def _probabilities(q, k, q_seg, q_pos, kv_seg, kv_pos, lse):
  """f32[tq, tk]: the whole attention's probabilities of one tile pair (0 where masked)."""
  s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32)
  return jnp.where(_mask(q_seg, q_pos, kv_seg, kv_pos), jnp.exp(s - lse[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref, lse_ref,
               delta_ref, dout_ref, dq_ref):
  """dq of one query tile of one head: refs as `_forward_kernel`'s; lse_ref, delta_ref: [tq];
  dout_ref, dq_ref: [tq, d]."""
  q, q_seg, q_pos = q_ref[...], q_seg_ref[...], q_pos_ref[...]
  lse, delta, dout = lse_ref[...], delta_ref[...], dout_ref[...]

  def visit(j, dq):
    at = pl.ds(j * TILE, TILE)
    kv_seg, kv_pos = kv_seg_ref[at], kv_pos_ref[at]

    def update(dq):
      k = k_ref[at, :]
      p = _probabilities(q, k, q_seg, q_pos, kv_seg, kv_pos, lse)
      ds = p * (plgpu.dot(dout, v_ref[at, :], trans_b=True).astype(jnp.float32) - delta[:, None])
      return dq + plgpu.dot(ds.astype(k.dtype), k).astype(jnp.float32)

    return jax.lax.cond(_some_causally_visible(q_pos, kv_pos), update, lambda x: x, dq)

  dq_ref[...] = jax.lax.fori_loop(0, k_ref.shape[0] // TILE, visit,
                                  jnp.zeros(q_ref.shape, jnp.float32))


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref, lse_ref,
                delta_ref, dout_ref, dk_ref, dv_ref):
  """dk, dv of one key tile from one query head: q_ref, dout_ref: [sq, d]; q_seg_ref,
  q_pos_ref, lse_ref, delta_ref: [sq]; k_ref, v_ref, dk_ref, dv_ref: [tk, d]; kv_seg_ref,
  kv_pos_ref: [tk]."""
  k, v, kv_seg, kv_pos = k_ref[...], v_ref[...], kv_seg_ref[...], kv_pos_ref[...]

  def visit(i, grads):
    at = pl.ds(i * TILE, TILE)
    q_pos = q_pos_ref[at]

    def update(grads):
      dk, dv = grads
      q, dout = q_ref[at, :], dout_ref[at, :]
      p = _probabilities(q, k, q_seg_ref[at], q_pos, kv_seg, kv_pos, lse_ref[at])
      dv = dv + plgpu.dot(p.astype(dout.dtype), dout, trans_a=True).astype(jnp.float32)
      ds = p * (plgpu.dot(dout, v, trans_b=True).astype(jnp.float32) - delta_ref[at][:, None])
      return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32), dv

    return jax.lax.cond(_some_causally_visible(q_pos, kv_pos), update, lambda x: x, grads)

  zeros = jnp.zeros(k_ref.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // TILE, visit, (zeros, zeros))
  dk_ref[...], dv_ref[...] = dk, dv


def _padded(x, axis, size, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _tiles(n: int) -> int:
  return -(-n // TILE) * TILE


def _head_dim(d: int) -> int:
  return 1 << max(4, (d - 1).bit_length())


class _Layout:
  """The chunk's arrays padded for the kernels, and the BlockSpecs that cut them.

  Grids are (tile, row, query head); a query head h reads KV head h // group."""

  def __init__(self, q, k, q_seg, q_pos, kv_seg, kv_pos):
    self.b, self.sq, self.h, self.d = q.shape
    self.sk, self.kh = k.shape[1], k.shape[2]
    self.group = self.h // self.kh
    self.pq, self.pk, self.pd = _tiles(self.sq), _tiles(self.sk), _head_dim(self.d)
    self.q_seg = _padded(q_seg.astype(jnp.int32), 1, self.pq)
    self.q_pos = _padded(q_pos.astype(jnp.int32), 0, self.pq, -1)
    self.kv_seg = _padded(kv_seg.astype(jnp.int32), 1, self.pk)
    self.kv_pos = _padded(kv_pos.astype(jnp.int32), 0, self.pk, _FAR)

  def rows(self, x, length):
    """[b, s, heads, d] -> [b, length, heads, padded d]."""
    return _padded(_padded(x, 3, self.pd), 1, length)

  def per_head(self, x):
    """[b, sq, h] -> [b, h, padded sq] (one contiguous row per program)."""
    return _padded(x.transpose(0, 2, 1), 2, self.pq)

  def query_tile(self):  # q, dout, out of one (query tile, row, head)
    return pl.BlockSpec((None, TILE, None, self.pd), lambda i, b, h: (b, i, h, 0))

  def all_queries(self):
    return pl.BlockSpec((None, self.pq, None, self.pd), lambda i, b, h: (b, 0, h, 0))

  def key_tile(self):
    return pl.BlockSpec((None, TILE, None, self.pd), lambda i, b, h: (b, i, h // self.group, 0))

  def all_keys(self):
    return pl.BlockSpec((None, self.pk, None, self.pd),
                        lambda i, b, h: (b, 0, h // self.group, 0))

  def query_meta(self, whole: bool):  # q_seg, q_pos (, lse, delta with per_head)
    return _meta_specs(self.pq if whole else None)

  def key_meta(self, whole: bool):
    return _meta_specs(self.pk if whole else None)

  def per_head_spec(self, whole: bool):
    if whole:
      return pl.BlockSpec((None, None, self.pq), lambda i, b, h: (b, h, 0))
    return pl.BlockSpec((None, None, TILE), lambda i, b, h: (b, h, i))


def _meta_specs(whole: int | None):
  """BlockSpecs of one side's segment ids [b, length] and positions [length]: all `whole` of
  them in each program, or (None) the program's tile."""
  if whole:
    return (pl.BlockSpec((None, whole), lambda i, b, h: (b, 0)),
            pl.BlockSpec((whole,), lambda i, b, h: (0,)))
  return (pl.BlockSpec((None, TILE), lambda i, b, h: (b, i)),
          pl.BlockSpec((TILE,), lambda i, b, h: (i,)))


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def chunk_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """Queries against one key/value chunk (the contract of cpu.chunk_forward).

  q (already scaled): [b, sq, h, d]; k, v: [b, sk, kh, d], bf16 or f16; q_seg: i32[b, sq];
  q_pos: i32[sq]; kv_seg: i32[b, sk]; kv_pos: i32[sk]. Query i sees key j iff kv_pos[j] <=
  q_pos[i] in the same nonzero segment. -> (out f32[b, sq, h, d], lse f32[b, sq, h], +inf where
  a query sees no key).
  """
  x = _Layout(q, k, q_seg, q_pos, kv_seg, kv_pos)
  out, lse = pl.pallas_call(
      _forward_kernel, grid=(x.pq // TILE, x.b, x.h),
      in_specs=[x.query_tile(), x.all_keys(), x.all_keys(), *x.query_meta(False),
                *x.key_meta(True)],
      out_specs=[x.query_tile(), x.per_head_spec(False)],
      out_shape=[jax.ShapeDtypeStruct((x.b, x.pq, x.h, x.pd), jnp.float32),
                 jax.ShapeDtypeStruct((x.b, x.h, x.pq), jnp.float32)],
      interpret=_interpret(), name="longrl_chunk_forward",
  )(x.rows(q, x.pq), x.rows(k, x.pk), x.rows(v, x.pk), x.q_seg, x.q_pos, x.kv_seg, x.kv_pos)
  return out[:, :x.sq, :, :x.d], lse[:, :, :x.sq].transpose(0, 2, 1)


def chunk_backward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, lse, delta, dout):
  """-> (dq, dk, dv) f32 of `chunk_forward`'s arguments, from the log-sum-exp and delta =
  sum(dout * out, -1), both f32[b, sq, h], of the whole attention (all key chunks)."""
  x = _Layout(q, k, q_seg, q_pos, kv_seg, kv_pos)
  args = (x.rows(q, x.pq), x.rows(k, x.pk), x.rows(v, x.pk), x.q_seg, x.q_pos, x.kv_seg,
          x.kv_pos, x.per_head(lse), x.per_head(delta), x.rows(dout.astype(q.dtype), x.pq))
  call = functools.partial(pl.pallas_call, interpret=_interpret())
  dq = call(
      _dq_kernel, grid=(x.pq // TILE, x.b, x.h),
      in_specs=[x.query_tile(), x.all_keys(), x.all_keys(), *x.query_meta(False),
                *x.key_meta(True), x.per_head_spec(False), x.per_head_spec(False),
                x.query_tile()],
      out_specs=x.query_tile(),
      out_shape=jax.ShapeDtypeStruct((x.b, x.pq, x.h, x.pd), jnp.float32),
      name="longrl_chunk_dq")(*args)
  # dk, dv per query head: [b, pk, h, pd], summed over each KV head's group below.
  per_query_head = pl.BlockSpec((None, TILE, None, x.pd), lambda i, b, h: (b, i, h, 0))
  dk, dv = call(
      _dkv_kernel, grid=(x.pk // TILE, x.b, x.h),
      in_specs=[x.all_queries(), x.key_tile(), x.key_tile(), *x.query_meta(True),
                *x.key_meta(False), x.per_head_spec(True), x.per_head_spec(True),
                x.all_queries()],
      out_specs=[per_query_head, per_query_head],
      out_shape=[jax.ShapeDtypeStruct((x.b, x.pk, x.h, x.pd), jnp.float32)] * 2,
      name="longrl_chunk_dkv")(*args)
  by_kv_head = lambda g: g[:, :x.sk, :, :x.d].reshape(x.b, x.sk, x.kh, x.group, x.d).sum(3)
  return dq[:, :x.sq, :, :x.d], by_kv_head(dk), by_kv_head(dv)
