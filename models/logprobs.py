"""Per-token log-probs and entropy of given targets, computed chunk by chunk.

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
