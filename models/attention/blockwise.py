"""Blockwise (flash-style) causal attention with a recomputing backward pass.

Owns the online-softmax arithmetic over (query block, key block) tiles, for one device: the
forward keeps a running max, normaliser and output per query block; the custom VJP keeps only
(q, k, v, out, logsumexp) and recomputes each tile's probabilities, so memory is linear in the
sequence length. Tiles whose mask is empty are skipped at run time (`lax.cond`), which halves the
causal work and skips padding.

The tile functions take explicit segment ids and causal indices for both sides, so that ring
attention (models/attention/ring.py) can run them on key chunks that arrive from other devices.
Grouped-query heads are handled by grouping query heads under their key/value head: keys and
values are never repeated.

Masking rule, the same as the dense reference: query i sees key j iff index[j] <= index[i],
segment[j] == segment[i] and segment[i] != 0. A query that sees no key outputs zeros. Without
causality (`attention(..., causal=False)`, the vision tower's) every index is 0: a query sees
its whole segment.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 256  # fastest of 128/256/512 on CPU at 4k tokens (bench/attention.py)
# Up to this many (query tile, key tile) pairs per chunk, the tile loops are unrolled: static
# slices instead of a loop's dynamic ones and its in-place updates. Attention at 512 tokens (2 x 2
# tiles), forward and backward, ran ~1.1x faster so; 16 covers 1k tokens in 256-token tiles.
UNROLL_TILES = 16


class Blocks(NamedTuple):
  """One side (queries or keys) cut into tiles.

  seg: i32[blocks, batch, block] segment ids (0 = padding); idx: i32[blocks, block] causal order.
  """
  seg: jax.Array
  idx: jax.Array


class SoftmaxState(NamedTuple):
  """Online-softmax accumulators for every query tile: f32[q_blocks, b, kv_heads, group, bq(, d)]."""
  acc: jax.Array
  m: jax.Array  # running max of the scores (-inf until a key is seen)
  l: jax.Array  # running sum of exp(score - m)


def _tile_mask(qm_seg, qm_idx, km_seg, km_idx):
  """bool[b, bq, bk] for one (query tile, key tile) pair."""
  causal = km_idx[None, :] <= qm_idx[:, None]
  same = qm_seg[:, :, None] == km_seg[:, None, :]
  return causal[None] & same & (qm_seg != 0)[:, :, None]


def _scores(q, k, mask):
  """q: [b, kh, g, bq, d] (already scaled); k: [b, kh, bk, d] -> f32[b, kh, g, bq, bk]."""
  s = jnp.einsum("bkgqd,bktd->bkgqt", q, k, preferred_element_type=jnp.float32)
  return jnp.where(mask[:, None, None], s, -jnp.inf)


def init_state(q_blocks) -> SoftmaxState:
  shape = q_blocks.shape[:-1]
  return SoftmaxState(jnp.zeros(q_blocks.shape, jnp.float32),
                      jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32))


def _update_tile(state, q, k, v, mask):
  acc, m, l = state
  s = _scores(q, k, mask)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # no key yet: avoid inf - inf
  p = jnp.exp(s - m_safe[..., None])
  correction = jnp.exp(m - m_safe)
  l = l * correction + jnp.sum(p, axis=-1)
  pv = jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return SoftmaxState(acc * correction[..., None] + pv, m_new, l)


def attend_chunk(state: SoftmaxState, q_blocks, q_meta: Blocks, k_blocks, v_blocks,
                 kv_meta: Blocks) -> SoftmaxState:
  """Fold one chunk of keys into the running softmax of every query tile.

  q_blocks: [nq, b, kh, g, bq, d]; k_blocks, v_blocks: [nk, b, kh, bk, d]. Up to
  UNROLL_TILES tile pairs are unrolled; more run in a loop that updates the state tile by tile in
  place (a loop, not a map), so only one copy of it is live.
  """

  def fold(tile, i, j):  # tile: the SoftmaxState of query tile i
    mask = _tile_mask(q_meta.seg[i], q_meta.idx[i], kv_meta.seg[j], kv_meta.idx[j])
    return jax.lax.cond(jnp.any(mask), _update_tile, lambda tile, *_: tile, tile, q_blocks[i],
                        k_blocks[j], v_blocks[j], mask)

  nq, nk = q_blocks.shape[0], k_blocks.shape[0]
  if nq * nk <= UNROLL_TILES:
    tiles = []
    for i in range(nq):
      tile = SoftmaxState(*(x[i] for x in state))
      for j in range(nk):
        tile = fold(tile, i, j)
      tiles.append(tile)
    return SoftmaxState(*(jnp.stack(x) for x in zip(*tiles)))

  def one_q_tile(i, state):
    tile = _while_fori(nk, lambda j, tile: fold(tile, i, j),
                       SoftmaxState(*(x[i] for x in state)))
    return SoftmaxState(*(x.at[i].set(t) for x, t in zip(state, tile)))

  return _while_fori(nq, one_q_tile, state)


def _while_fori(n: int, body, init):
  """`jax.lax.fori_loop(0, n, body, init)` as a while loop, for the forward pass.

  With static bounds fori_loop is a scan, and JAX's partial evaluation splits a scan into the
  part that depends only on known inputs and the rest, stacking the known part's values of
  every iteration. Under the scan over layers (models/transformer.py `scan_layers`), segment
  ids and causal indices are loop-invariant, so the tile masks (and the -inf fill of the masked
  scores) of every (query tile, key tile) pair were hoisted out of the layer loop and kept:
  O(seq^2) memory, 4.1 GiB more temporaries for one Qwen2.5-0.5B layer at 8k tokens. A while
  loop is partially evaluated whole. It cannot be reverse-differentiated, which the forward
  does not need: the custom VJPs (here and in ring.py) never differentiate it.
  """
  def step(carry):
    i, x = carry
    return i + 1, body(i, x)

  return jax.lax.while_loop(lambda carry: carry[0] < n, step, (jnp.int32(0), init))[1]


def finalize(state: SoftmaxState):
  """-> (out f32[nq, b, kh, g, bq, d], lse f32[nq, b, kh, g, bq]); lse = +inf where no key was seen,
  so that exp(score - lse) is 0 there in the backward pass."""
  seen = state.l > 0
  out = state.acc / jnp.where(seen, state.l, 1.0)[..., None]
  lse = jnp.where(seen, state.m + jnp.log(jnp.where(seen, state.l, 1.0)), jnp.inf)
  return out, lse


def _tile_grads(q, k, v, dout, lse, delta, mask):
  """One tile's gradient terms (dk, dv, dq), f32, from the probabilities recomputed with the
  forward's logsumexp; q, dout: [b, kh, g, bq, d]; k, v: [b, kh, bk, d]."""
  p = jnp.exp(_scores(q, k, mask) - lse[..., None])
  dp = jnp.einsum("bkgqd,bktd->bkgqt", dout, v, preferred_element_type=jnp.float32)
  ds = p * (dp - delta[..., None])
  # The key-side gradients contract over (group, query) as one merged axis: with two
  # contracting axes XLA:CPU first copies the probabilities into a transposed layout.
  merge = lambda x: x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
  dv = jnp.einsum("bkmt,bkmd->bktd", merge(p), merge(dout), preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkmt,bkmd->bktd", merge(ds), merge(q), preferred_element_type=jnp.float32)
  dq = jnp.einsum("bkgqt,bktd->bkgqd", ds, k, preferred_element_type=jnp.float32)
  return dk, dv, dq


def grad_chunk(grads, q_blocks, q_meta: Blocks, dout_blocks, lse, delta, k_blocks, v_blocks,
               kv_meta: Blocks):
  """Add one chunk of keys' gradient terms to `grads` = (dq, dk, dv), all f32, in place.

  dq: [nq, b, kh, g, bq, d], with respect to the scaled queries; dk, dv: [nk, b, kh, bk, d]
  for this chunk's keys. delta: f32[nq, b, kh, g, bq] = sum(dout * out, -1). Unrolled up to
  UNROLL_TILES tile pairs, as `attend_chunk`.
  """

  def add_tile(dq_i, dk_j, dv_j, i, j):
    mask = _tile_mask(q_meta.seg[i], q_meta.idx[i], kv_meta.seg[j], kv_meta.idx[j])

    def compute(dq_i, dk_j, dv_j):
      dk_t, dv_t, dq_t = _tile_grads(q_blocks[i], k_blocks[j], v_blocks[j], dout_blocks[i],
                                     lse[i], delta[i], mask)
      return dq_i + dq_t, dk_j + dk_t, dv_j + dv_t

    return jax.lax.cond(jnp.any(mask), compute, lambda *tiles: tiles, dq_i, dk_j, dv_j)

  nq, nk = q_blocks.shape[0], k_blocks.shape[0]
  if nq * nk <= UNROLL_TILES:
    dq, dk, dv = (list(x) for x in grads)  # tiles
    for j in range(nk):
      for i in range(nq):
        dq[i], dk[j], dv[j] = add_tile(dq[i], dk[j], dv[j], i, j)
    return jnp.stack(dq), jnp.stack(dk), jnp.stack(dv)

  def one_k_tile(j, grads):
    dq, dk, dv = grads

    def one_q_tile(i, carry):
      dq, dk_j, dv_j = carry
      dq_i, dk_j, dv_j = add_tile(dq[i], dk_j, dv_j, i, j)
      return dq.at[i].set(dq_i), dk_j, dv_j

    dq, dk_j, dv_j = jax.lax.fori_loop(0, nq, one_q_tile, (dq, dk[j], dv[j]))
    return dq, dk.at[j].set(dk_j), dv.at[j].set(dv_j)

  return jax.lax.fori_loop(0, nk, one_k_tile, grads)


def zero_grads(q_blocks, k_blocks, v_blocks):
  """f32 zeros shaped like (q_blocks, k_blocks, v_blocks): the accumulators of `grad_chunk`."""
  return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q_blocks, k_blocks, v_blocks))


# ---- layout: [b, s, heads, d] <-> tiles ----

def to_q_blocks(q, block):
  """[b, s, kh, g, d] (query heads grouped under their KV head) -> [nq, b, kh, g, block, d]."""
  b, s, kh, g, d = q.shape
  q = _pad_seq(q, block).reshape(b, -1, block, kh, g, d)
  return q.transpose(1, 0, 3, 4, 2, 5)


def from_q_blocks(x, seq):
  """[nq, b, kh, g, block, d] -> [b, seq, kh * g, d]."""
  nq, b, kh, g, block, d = x.shape
  return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * block, kh * g, d)[:, :seq]


def to_kv_blocks(k, block):
  """[b, s, kh, d] -> [nk, b, kh, block, d]."""
  b, s, kh, d = k.shape
  return _pad_seq(k, block).reshape(b, -1, block, kh, d).transpose(1, 0, 3, 2, 4)


def to_meta(segment_ids, index, block) -> Blocks:
  """segment_ids: i32[b, s]; index: i32[s] -> Blocks (padding gets segment 0)."""
  seg = _pad_seq(segment_ids, block)
  idx = _pad_seq(index[None], block)[0]
  return Blocks(seg.reshape(seg.shape[0], -1, block).transpose(1, 0, 2), idx.reshape(-1, block))


def _pad_seq(x, block):
  pad = -x.shape[1] % block
  if not pad:
    return x
  return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def block_size(seq, requested):
  """The tile size for a sequence: `requested`, or the whole sequence when it is shorter."""
  return max(1, min(requested, seq))


# ---- the single-device kernel ----

@jax.custom_vjp
def _flash(q_blocks, k_blocks, v_blocks, q_meta, kv_meta):
  return _flash_fwd(q_blocks, k_blocks, v_blocks, q_meta, kv_meta)[0]


def _flash_fwd(q_blocks, k_blocks, v_blocks, q_meta, kv_meta):
  state = attend_chunk(init_state(q_blocks), q_blocks, q_meta, k_blocks, v_blocks, kv_meta)
  out, lse = finalize(state)
  out = out.astype(q_blocks.dtype)
  return out, (q_blocks, k_blocks, v_blocks, q_meta, kv_meta, out, lse)


def _flash_bwd(residuals, dout):
  q_blocks, k_blocks, v_blocks, q_meta, kv_meta, out, lse = residuals
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  dq, dk, dv = grad_chunk(zero_grads(q_blocks, k_blocks, v_blocks), q_blocks, q_meta, dout,
                          lse, delta, k_blocks, v_blocks, kv_meta)
  return (dq.astype(q_blocks.dtype), dk.astype(k_blocks.dtype), dv.astype(v_blocks.dtype),
          None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(q, k, v, segment_ids, *, causal: bool = True, block_q: int = DEFAULT_BLOCK,
              block_k: int = DEFAULT_BLOCK):
  """Causal attention within segments, memory linear in the sequence length; with
  causal=False each query sees its whole segment (a vision tower's windows and images).

  Args:
    q: [batch, seq, num_heads, head_dim]
    k, v: [batch, seq, num_kv_heads, head_dim]
    segment_ids: i32[batch, seq]; 0 marks padding (its output is zero).
    block_q, block_k: tile sizes; any sequence length works (the tail tile is padded).
  Returns:
    [batch, seq, num_heads, head_dim] in q's dtype.
  """
  b, s, h, d = q.shape
  kh = k.shape[2]
  bq, bk = block_size(s, block_q), block_size(s, block_k)
  # one causal index for all: every key is at or before every query
  index = jnp.arange(s, dtype=jnp.int32) if causal else jnp.zeros(s, jnp.int32)
  scaled = (q * d ** -0.5).astype(q.dtype).reshape(b, s, kh, h // kh, d)
  out = _flash(to_q_blocks(scaled, bq), to_kv_blocks(k, bk), to_kv_blocks(v, bk),
               to_meta(segment_ids, index, bq), to_meta(segment_ids, index, bk))
  return from_q_blocks(out, s)
