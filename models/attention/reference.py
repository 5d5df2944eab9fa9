"""Dense reference attention with grouped-query heads and an explicit boolean mask.

Owns the attention arithmetic and the masks for packed training rows and for a KV cache.
Memory is O(queries x keys); the blockwise and ring kernels replace it for long sequences and
are tested against it. The embedded engine's decode steps (one query against the cache) use it.
"""

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so fully masked (padding) rows never give NaN gradients


def attention(q, k, v, mask):
  """Softmax attention; KV heads are shared by groups of query heads, never repeated.

  Args:
    q: [batch, q_len, num_heads, head_dim]
    k, v: [batch, kv_len, num_kv_heads, head_dim]
    mask: bool[batch, q_len, kv_len]; True where the query may attend to the key.
  Returns:
    [batch, q_len, num_heads, head_dim] in q's dtype.
  """
  return cached_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)


def cached_attention(q, k, v, mask):
  """`attention` with keys and values in the KV cache's layout, heads before positions.

  q: [batch, q_len, num_heads, head_dim]; k, v: [batch, num_kv_heads, kv_len, head_dim];
  mask: bool[batch, q_len, kv_len] -> [batch, q_len, num_heads, head_dim].
  """
  b, s, h, d = q.shape
  kv_heads = k.shape[1]
  q = q.reshape(b, s, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("bskgd,bktd->bkgst", q, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1)
  # A query that sees no key (padding) would otherwise average every value; it outputs zero.
  probs = jnp.where(mask[:, None, None, :, :], probs, 0.0).astype(v.dtype)
  out = jnp.einsum("bkgst,bktd->bkgsd", probs, v)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def segment_causal_mask(segment_ids):
  """Mask for packed rows: causal, within one segment, never to or from padding (segment 0).

  segment_ids: i32[batch, seq] -> bool[batch, seq, seq]
  """
  seq = segment_ids.shape[1]
  causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  real = (segment_ids != 0)[:, :, None]
  return causal[None] & same & real


def cache_mask(kv_valid, first_slot, q_len):
  """Mask for queries written at cache slots [first_slot, first_slot + q_len).

  kv_valid: bool[batch, cache_len], False for padding slots -> bool[batch, q_len, cache_len]
  """
  q_slot = first_slot + jnp.arange(q_len)
  k_slot = jnp.arange(kv_valid.shape[1])
  causal = k_slot[None, :] <= q_slot[:, None]
  return causal[None] & kv_valid[:, None, :]
