"""The programs that decode and score with the model, shared by the embedded engine
(rollouts/jax_engine.py) and our server's scheduler (rollouts/server/scheduler.py).

Owns the token choice (temperature, nucleus, greedy; inverse-transform sampling), the shape
buckets that keep compiles few, one image batcher for vision-language prompts (each row's
multimodal RoPE positions and its images placed at their slots), the embedded engine's whole
decode loop in one program (`sample`), the server's step-wise programs (`prefill_logits`,
`decode_step`, `grow`: the scheduler runs the loop on the host, so that aborts, pauses and
weight updates land between tokens) and the scoring of given tokens (a prefill returning
their log-probs: a teacher's or a judge's). It does not own batching policy, weights or
requests: those are the engine's and the scheduler's.

The two decoders differ where their contracts do: the embedded engine samples a batch with one
temperature and top-p and returns log-probs at temperature 1 (what the trainer recomputes);
the server samples each row with its own settings and PRNG key and returns SGLang's log-probs,
log_softmax(logits / temperature) (raw when greedy).
"""

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import logprobs as logprobs_lib
from models import projections, transformer, vision
from models.config import ModelConfig, VisionConfig

# A temperature below this decodes greedily (SGLang's sampler treats it as 0).
GREEDY_BELOW = 1e-6


def bucket(n: int, minimum: int) -> int:
  """The next power of two >= max(n, minimum)."""
  return max(minimum, 1 << (n - 1).bit_length())



def shape_bucket(n: int, minimum: int) -> int:
  """The smallest of minimum x (1, 1.5, 2, 3, 4, 6, 8, ...) that is >= n: powers of two and 1.5x
  powers of two, so that a server meets few batch shapes (each a compile of seconds on a CPU)
  while, above the minimum, less than a third of a bucket is padding."""
  power = bucket(n, minimum)
  return power * 3 // 4 if power >= 2 * minimum and n <= power * 3 // 4 else power



def nucleus(scaled, top_p):
  """Logits outside the smallest set of tokens whose probability mass reaches top_p -> -inf."""
  sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1)
  return jnp.where(scaled >= cutoff[:, None], scaled, -jnp.inf)


def categorical(key, logits):
  """One token per row of logits f32[batch, vocab], drawn with probability softmax(logits)
  (-inf: never), by inverse transform sampling: a single uniform per row against the
  cumulative probabilities. jax.random.categorical draws a Gumbel per vocabulary entry
  instead (two logarithms and a random number each): on CPU that was 75% of a sampled
  decode step at vocabulary 8192. Returns i32[batch]."""
  cumulative = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
  # Scaled by the total so that rounding in the sum cannot leave u past the last token.
  u = jax.random.uniform(key, (logits.shape[0], 1)) * cumulative[:, -1:]
  # Tokens of probability 0 add nothing to the sum, so `<=` never stops on one.
  chosen = jnp.sum(cumulative <= u, axis=-1)
  return jnp.minimum(chosen, logits.shape[-1] - 1).astype(jnp.int32)


def choose_tokens(key, logits, temperature, top_p):
  """Sample from logits f32[batch, vocab] with temperature and nucleus cut; argmax when
  temperature == 0. Returns i32[batch].

  Branches are lax.cond, so greedy decoding and top_p = 1 never pay for the vocabulary sort
  (on CPU the sort costs as much as a decode step of a small model).
  """

  def sample(_):
    scaled = logits / temperature
    scaled = jax.lax.cond(top_p < 1.0, nucleus, lambda s, _: s, scaled, top_p)
    return categorical(key, scaled)

  def greedy(_):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  return jax.lax.cond(temperature > 0, sample, greedy, None)


class PromptImages(NamedTuple):
  """A batch of left-padded prompts' images, for a vision-language model.

  images: the vision tower's input, every prompt's images in row order; positions
  i32[batch, prompt_len, 3] each prompt token's multimodal RoPE position (padding 0);
  next_positions i32[batch] the position of each row's first generated token (its largest
  position + 1: tokens after the images count on from there on all three axes, SGLang's
  mrope_position_delta).
  """
  images: vision.Images
  positions: jax.Array
  next_positions: jax.Array


def prompt_images(cfg: VisionConfig, prompts: Sequence[Sequence[int] | None],
                  images: Sequence[Sequence[vision.PatchedImage]], batch: int, plen: int,
                  min_patches: int = 64) -> PromptImages:
  """PromptImages of `prompts` (None: a padding row) left-padded into [batch, plen], each
  with its `images` in the order of its runs of image tokens. A prompt with images has its
  multimodal RoPE positions (models/vision.py), one without counts from 0 on all three axes
  (its image tokens, if any, are plain tokens, as SGLang takes a request without
  image_data). The images' patches are padded to a power-of-two count (few shapes)."""
  positions = np.zeros((batch, plen, 3), np.int32)
  next_positions = np.ones((batch,), np.int32)
  flat, slots = [], []
  for row, (p, ims) in enumerate(zip(prompts, images)):
    if p is None:
      continue
    pad = plen - len(p)
    at = (vision.mrope_positions(p, [im.grid for im in ims], cfg) if ims
          else np.repeat(np.arange(len(p))[:, None], 3, axis=1))
    positions[row, pad:] = at
    next_positions[row] = at.max() + 1
    flat += ims
    slots += [row * plen + pad + i for i in vision.placeholder_slots(p, cfg)] if ims else []
  patches = sum(im.patches.shape[0] for im in flat)
  return PromptImages(vision.batch_images(flat, cfg, slots, bucket(max(patches, 1),
                                                                   min_patches)),
                      positions, next_positions)


def _logits(hidden, params, cfg: ModelConfig):
  """The next-token logits f32[rows, vocab] after each row's last hidden state."""
  return hidden[:, -1] @ transformer.output_projection(params, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_logits(params, prompts, positions, kv_valid, cache, images=None, *, cfg):
  """(next-token logits f32[rows, vocab], cache, a mixture's experts of the prompt tokens
  i32[rows, width, sparse layers, k] or None) of left-padded `prompts` i32[rows, width].
  `images`: the prompts' (vision.Images), positions then i32[rows, width, 3]."""
  hidden, cache, routes = transformer.prefill(params, cfg, prompts, positions,
                                              kv_valid[:, :prompts.shape[1]].astype(jnp.int32),
                                              cache, images)
  return _logits(hidden, params, cfg), cache, None if routes is None else routes.experts


def decode_logits(params, cfg: ModelConfig, token, positions, kv_valid, cache, slot):
  """Feed token i32[rows] at `positions` i32[rows] into cache slot `slot`: (the logits after
  it f32[rows, vocab], the cache, a mixture's experts of it i32[rows, sparse layers, k] or
  None)."""
  hidden, cache, routes = transformer.decode(params, cfg, token[:, None], positions[:, None],
                                             kv_valid, cache, slot)
  return _logits(hidden, params, cfg), cache, None if routes is None else routes.experts[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "stop_ids"))
def sample(params, prompts, prompt_lens, key, temperature, top_p, images=None, *,
           cfg: ModelConfig, max_new: int, stop_ids: tuple[int, ...]):
  """The embedded engine's decode: up to `max_new` tokens for left-padded prompts, in one
  program (a while loop that ends when every row has stopped).

  Args:
    prompts: i32[batch, prompt_len], each prompt right-aligned (left padding).
    prompt_lens: i32[batch] real prompt lengths (>= 1).
    images: for a vision-language model, the prompts' `PromptImages` (their images and
      multimodal RoPE positions), else None.
  Returns:
    tokens i32[batch, max_new] (0 after a row finished), logp f32[batch, max_new] (at
    temperature 1), lengths i32[batch] tokens generated, stopped bool[batch] (ended on a stop
    token), and for a mixture of experts the experts each token went to, i32[batch,
    prompt_len + max_new, sparse layers, k] (the prompt's at their slots, each generated
    token's once it was fed back; -1 where none), else None.
  """
  params = projections.unpack_projections(params)  # once, not at every decode step
  batch, plen = prompts.shape
  pad = plen - prompt_lens
  slots = jnp.arange(plen)
  positions = jnp.maximum(slots[None, :] - pad[:, None], 0)
  next_positions = prompt_lens  # of the first generated token
  if images is not None:
    positions, next_positions = images.positions, images.next_positions
  kv_valid = jnp.zeros((batch, plen + max_new), bool).at[:, :plen].set(
      slots[None, :] >= pad[:, None])
  cache = transformer.init_cache(cfg, batch, plen + max_new)
  logits, cache, prompt_experts = prefill_logits(
      params, prompts, positions, kv_valid, cache, None if images is None else images.images,
      cfg=cfg)
  experts = None
  if prompt_experts is not None:  # rollout routing replay: what the trainer routes the same way
    experts = jnp.full((batch, plen + max_new, *prompt_experts.shape[2:]), -1, jnp.int32)
    experts = experts.at[:, :plen].set(prompt_experts)
  stop_ids = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

  def step(carry):
    i, logits, cache, kv_valid, tokens, logp, done, key, experts = carry
    key, sub = jax.random.split(key)
    token = choose_tokens(sub, logits, temperature, top_p)
    token_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
    tokens = tokens.at[:, i].set(jnp.where(done, 0, token))
    logp = logp.at[:, i].set(jnp.where(done, 0.0, token_logp))
    kv_valid = kv_valid.at[:, plen + i].set(~done)
    done = done | jnp.isin(token, stop_ids)
    logits, cache, fed = decode_logits(params, cfg, token, next_positions + i, kv_valid,
                                       cache, plen + i)
    if fed is not None:
      experts = experts.at[:, plen + i].set(fed)
    return i + 1, logits, cache, kv_valid, tokens, logp, done, key, experts

  def keep_going(carry):
    i, *_, done, _, _ = carry
    return (i < max_new) & ~jnp.all(done)

  init = (jnp.int32(0), logits, cache, kv_valid, jnp.zeros((batch, max_new), jnp.int32),
          jnp.zeros((batch, max_new), jnp.float32), jnp.zeros((batch,), bool), key, experts)
  _, _, _, kv_valid, tokens, logp, stopped, _, experts = jax.lax.while_loop(keep_going, step,
                                                                            init)
  lengths = jnp.sum(kv_valid[:, plen:], axis=1).astype(jnp.int32)
  return tokens, logp, lengths, stopped, experts


@functools.partial(jax.jit, static_argnums=2)
def grow(cache, kv_valid, extra: int):
  """The cache and its validity mask with `extra` more (empty) slots at the end."""
  pad = lambda x: jnp.pad(x, [(0, 0)] * 2 + [(0, extra), (0, 0)])  # the slot axis
  return (transformer.KVCache(*(tuple(map(pad, layers)) for layers in cache)),
          jnp.pad(kv_valid, [(0, 0), (0, extra)]))


@jax.jit
def request_keys(seeds):
  """One PRNG key per request u32[rows] seed: a request's draws depend on its seed alone."""
  return jax.vmap(jax.random.PRNGKey)(seeds)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, logits, cache, kv_valid, keys, temperature, top_p, positions, slot,
                active, i, *, cfg):
  """The server's step: choose token i of each row (per-row temperature, top-p and PRNG
  key), score it as SGLang does, and feed it back (decode_logits). Returns (token i32[rows],
  logp f32[rows], logits, cache, kv_valid, a mixture's experts of the token or None)."""
  keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
  greedy = temperature < GREEDY_BELOW
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  # The nucleus sorts the whole vocabulary of every row: only when some row asks for it.
  cut = jax.lax.cond(jnp.any(top_p < 1.0),
                     lambda: jnp.where((top_p < 1.0)[:, None], nucleus(scaled, top_p[:, None]),
                                       scaled),
                     lambda: scaled)
  sampled = jax.vmap(lambda k, l: categorical(k, l[None])[0])(keys, cut)
  token = jnp.where(greedy, jnp.argmax(logits, -1), sampled).astype(jnp.int32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], -1)[:, 0]
  kv_valid = kv_valid.at[:, slot].set(active)
  logits, cache, experts = decode_logits(params, cfg, token, positions, kv_valid, cache, slot)
  return token, logp, logits, cache, kv_valid, experts


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def sequence_scores(params, tokens, lengths, *, cfg: ModelConfig, k: int = 0):
  """One prefill of right-padded sequences, nothing generated: log p(tokens[b, t] |
  tokens[b, :t]) f32[batch, seq] and, with k > 0, the k most likely tokens at each position
  and their log-probs, i32 / f32[batch, seq, k] (else None). Zeros at t = 0 and past each
  row's length.

  tokens: i32[batch, seq]; lengths: i32[batch] (>= 1).
  """
  batch, seq = tokens.shape
  real = jnp.arange(seq)[None, :] < lengths[:, None]
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  hidden = transformer.forward(params, cfg, tokens, positions, real.astype(jnp.int32))
  unembed = transformer.output_projection(params, cfg)
  following = jnp.roll(tokens, -1, axis=1)  # the token each position predicts
  logp, _ = logprobs_lib.token_logprobs(hidden, unembed, following)
  # Position t-1 predicts token t: shift right by one.
  shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  keep = real & (jnp.arange(seq)[None, :] > 0)
  logp = jnp.where(keep, shift(logp), 0.0)
  if not k:
    return logp, None, None
  ids, top_logp = logprobs_lib.top_k(hidden, unembed, k)
  return (logp, jnp.where(keep[..., None], shift(ids), 0),
          jnp.where(keep[..., None], shift(top_logp), 0.0))


def _padded(sequences, pad_id: int, min_batch: int, min_len: int):
  rows, width = bucket(len(sequences), min_batch), bucket(max(map(len, sequences)), min_len)
  tokens = np.full((rows, width), pad_id, np.int32)
  lengths = np.ones((rows,), np.int32)
  for row, s in enumerate(sequences):
    tokens[row, :len(s)] = s
    lengths[row] = len(s)
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _scoring_batch(prompts, continuations, pad_id: int, min_batch: int, min_len: int):
  """(tokens, lengths) of the prompt + continuation sequences, or None when there are none."""
  if len(prompts) != len(continuations):
    raise ValueError(f"score: {len(prompts)} prompts for {len(continuations)} continuations")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("score: every prompt needs at least one token")
  sequences = [list(p) + list(c) for p, c in zip(prompts, continuations)]
  return _padded(sequences, pad_id, min_batch, min_len) if sequences else None


def score_continuations(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]], *, pad_id: int = 0,
                        min_batch: int = 8, min_len: int = 16) -> list[np.ndarray]:
  """The log-prob of each continuation token after its prompt and the tokens before it
  (temperature 1): one f32[len(continuation)] per pair, in batches of bucketed shape."""
  batch = _scoring_batch(prompts, continuations, pad_id, min_batch, min_len)
  if batch is None:
    return []
  logp = jax.device_get(sequence_scores(params, *batch, cfg=cfg)[0])
  return [logp[row, len(p):len(p) + len(c)].copy()
          for row, (p, c) in enumerate(zip(prompts, continuations))]


def score_continuations_top_k(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                              continuations: Sequence[Sequence[int]], k: int, *,
                              pad_id: int = 0, min_batch: int = 8, min_len: int = 16
                              ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """`score_continuations` and top-k distillation's teacher side, in one prefill: for each
  pair, its continuation's log-probs f32[n] and, at each of those n positions, the k tokens
  the model finds most likely there and their log-probs, i32[n, k] and f32[n, k]."""
  if k < 1:
    raise ValueError(f"score_continuations_top_k: k must be >= 1, got {k}")
  batch = _scoring_batch(prompts, continuations, pad_id, min_batch, min_len)
  if batch is None:
    return []
  logp, ids, top_logp = jax.device_get(sequence_scores(params, *batch, cfg=cfg, k=k))
  spans = [slice(len(p), len(p) + len(c)) for p, c in zip(prompts, continuations)]
  return [(logp[row, span].copy(), ids[row, span].copy(), top_logp[row, span].copy())
          for row, span in enumerate(spans)]
