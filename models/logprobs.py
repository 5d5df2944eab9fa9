"""Per-token log-probs and entropy of given targets, computed chunk by chunk (and, for top-k
distillation, the log-probs of k given tokens per position and a distribution's top k).

Owns the output head's arithmetic for training and scoring. Each chunk of tokens is
projected to the vocabulary, reduced, and dropped; `jax.checkpoint` on the chunk body makes
the backward pass recompute a chunk's logits instead of storing them, so peak memory is
O(chunk x vocab), never O(tokens x vocab).
"""

import functools

import jax
import jax.numpy as jnp


def token_logprobs(hidden, unembed, targets, *, chunk_size: int = 2048):
  """log p(target) and the entropy of the next-token distribution at every position.

  Args:
    hidden: f32[rows, seq, hidden] final hidden states.
    unembed: f32[hidden, vocab] output projection.
    targets: i32[rows, seq] the token whose log-prob is wanted at each position.
  Returns:
    (logp f32[rows, seq], entropy f32[rows, seq])
  """
  rows, seq, width = hidden.shape
  n = rows * seq
  chunk = min(chunk_size, n)
  pad = -n % chunk
  h = jnp.pad(hidden.reshape(n, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
  t = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_chunk(h_c, t_c):
    logits = jnp.dot(h_c, unembed, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0] - lse
    probs = jnp.exp(logits - lse[:, None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logp, entropy

  _, (logp, entropy) = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None, (h, t))
  logp = logp.reshape(-1)[:n].reshape(rows, seq)
  entropy = entropy.reshape(-1)[:n].reshape(rows, seq)
  return logp, entropy


def _chunked(hidden, chunk_size: int, *extra):
  """hidden f32[rows, seq, h] (and arrays [rows, seq, ...]) as [chunks, chunk, ...] with the
  padding it took; returns (chunks, n)."""
  rows, seq = hidden.shape[:2]
  n = rows * seq
  chunk = min(chunk_size, n)
  pad = -n % chunk
  flat = [x.reshape(n, *x.shape[2:]) for x in (hidden, *extra)]
  padded = [jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in flat]
  return [x.reshape(-1, chunk, *x.shape[1:]) for x in padded], n


def logprobs_of(hidden, unembed, ids, *, chunk_size: int = 2048):
  """log p(ids[r, t, j]) under the next-token distribution at every position: f32[rows, seq,
  k] for ids i32[rows, seq, k] (a teacher's top-k tokens, in top-k distillation)."""
  rows, seq, k = ids.shape
  (h, i), n = _chunked(hidden, chunk_size, ids)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_chunk(h_c, i_c):
    logits = jnp.dot(h_c, unembed, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(logits, i_c, axis=-1) - jax.nn.logsumexp(logits, -1)[:, None]

  _, out = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None, (h, i))
  return out.reshape(-1, k)[:n].reshape(rows, seq, k)


def top_k(hidden, unembed, k: int, *, chunk_size: int = 2048):
  """The k most likely next tokens at every position and their log-probs: (i32[rows, seq,
  k], f32[rows, seq, k]), most likely first."""
  rows, seq = hidden.shape[:2]
  (h,), n = _chunked(hidden, chunk_size)

  def one_chunk(h_c):
    logits = jnp.dot(h_c, unembed, preferred_element_type=jnp.float32)
    values, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), values - jax.nn.logsumexp(logits, -1)[:, None]

  _, (ids, logp) = jax.lax.scan(lambda c, x: (c, one_chunk(x)), None, h)
  return (ids.reshape(-1, k)[:n].reshape(rows, seq, k),
          logp.reshape(-1, k)[:n].reshape(rows, seq, k))
