"""Rotary position embeddings: the frequencies of every scaling a config can name (linear,
dynamic, yarn, llama3; models/config.py), their cos/sin tables and the rotation, multimodal
RoPE's sections included.

RoPE reads constant cos/sin tables per config (`rope_tables`), which carry the config's frequency
scaling, so that the training forward and the KV-cache passes rotate by the same angles.
"""

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from models.config import DynamicRope, Llama3Rope, LinearRope, RopeScaling, YarnRope


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse frequencies f32[head_dim / 2] under `scaling`, by the rule of its rope_type in
  Hugging Face's modeling_rope_utils, in its float32 order of operations (see the dataclasses
  in models/config.py for what each does)."""
  if isinstance(scaling, DynamicRope):  # at n = factor x max_position_embeddings tokens
    a = scaling.factor * scaling.factor - (scaling.factor - 1)
    theta = theta * a ** (head_dim / (head_dim - 2))
  wavelength_over_2pi = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  inv_freq = (1.0 / wavelength_over_2pi).astype(np.float32)
  match scaling:
    case None | DynamicRope():
      return inv_freq
    case LinearRope(factor=factor):
      return (inv_freq / np.float32(factor)).astype(np.float32)
    case YarnRope():
      return _yarn_frequencies(head_dim, theta, scaling, inv_freq, wavelength_over_2pi)
    case Llama3Rope():
      old = scaling.original_max_position_embeddings
      wavelen = 2 * math.pi / inv_freq
      scaled = np.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor,
                        inv_freq)
      smooth = ((old / wavelen - scaling.low_freq_factor) /
                (scaling.high_freq_factor - scaling.low_freq_factor))
      smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
      medium = ((wavelen >= old / scaling.high_freq_factor) &
                (wavelen <= old / scaling.low_freq_factor))
      return np.where(medium, smoothed, scaled).astype(np.float32)
  raise TypeError(f"rope scaling {scaling!r}; expected one of models.config.ROPE_SCALINGS")


def _yarn_frequencies(head_dim: int, theta: float, s: YarnRope, extrapolated,
                      wavelength_over_2pi) -> np.ndarray:
  """YaRN's blend of kept and interpolated frequencies: kept up to dimension `low` (which
  turns beta_fast times within the original context), interpolated from `high` (beta_slow
  turns), a linear ramp over the dimension index between."""

  def dimension(turns):  # the (fractional) dimension index that turns `turns` times
    return (head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) /
            (2 * math.log(theta)))

  low, high = dimension(s.beta_fast), dimension(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # as Hugging Face, against a zero-width ramp
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  kept = (1 - ramp).astype(np.float32)
  interpolated = (1.0 / (np.float32(s.factor) * wavelength_over_2pi)).astype(np.float32)
  return (interpolated * (1 - kept) + extrapolated * kept).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
  """The factor on cos and sin (so on q.k logits squared): YaRN's attention temperature,
  1 for every other scaling."""
  if not isinstance(scaling, YarnRope):
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


ROPE_FINE = ROPE_COARSE = 1024  # positions up to 1024 * 1024 = 2^20


class RopeTables(NamedTuple):
  """cos and sin of (position x inverse frequency), f32[n, head_dim / 2] each, for positions
  p = coarse * ROPE_FINE + fine: `fine_*` at p = 0 .. ROPE_FINE - 1, `coarse_*` at multiples
  of ROPE_FINE. The fine tables also carry `rope_attention_factor`, so that the product of a
  fine and a coarse entry is scaled by it once."""
  fine_cos: np.ndarray
  fine_sin: np.ndarray
  coarse_cos: np.ndarray
  coarse_sin: np.ndarray


@functools.lru_cache(maxsize=16)
def rope_tables(head_dim: int, theta: float, scaling: RopeScaling | None) -> RopeTables:
  """The tables of `rope_frequencies(head_dim, theta, scaling)`; one set per model config,
  so that every layer uses the same constants.

  Fine angles are float32 products, as Hugging Face computes every angle: below position
  ROPE_FINE cos and sin match its to about the last bit. Coarse angles are exact (float64):
  beyond, the angle is the true one to float32 precision, where Hugging Face's float32
  product is off by up to half an ulp of position x frequency (1/512 rad at position 32k).
  """
  inv_freq = rope_frequencies(head_dim, theta, scaling)
  fine = (np.arange(ROPE_FINE, dtype=np.float32)[:, None] * inv_freq).astype(np.float64)
  coarse = ROPE_FINE * np.arange(ROPE_COARSE, dtype=np.float64)[:, None] * inv_freq
  scale = rope_attention_factor(scaling)
  return RopeTables(*((f(a) * s).astype(np.float32)
                      for a, s in ((fine, scale), (coarse, 1.0)) for f in (np.cos, np.sin)))


def rope(x, positions, tables: RopeTables, mrope_section: tuple[int, ...] | None = None):
  """Rotary embedding, Hugging Face's rotate-half layout.

  x: [b, s, heads, d]; positions: i32[b, s], 0 <= positions < 2^20 (beyond: NaN), or
  i32[b, s, 3] (multimodal RoPE: the frequency pairs in `mrope_section` sections, the i-th
  turned by positions[..., i % 3], as transformers' Qwen2.5-VL; [b, s] turns all alike).

  cos and sin come from constant tables, by angle addition over the position's coarse and
  fine parts. Computed as cos(positions x inv_freq), XLA fused them into each consumer and
  evaluated them per head, forward and backward: ~0.25 s of thread time per train step of
  bench/peers.py (bench/rope.py: the step 1.04-1.08x faster at the median without them).
  """
  if positions.ndim == 3:
    turns = [_cos_sin(positions[..., i], tables) for i in range(3)]
    bounds = np.cumsum((0,) + tuple(mrope_section))
    cos, sin = (jnp.concatenate([turns[i % 3][part][..., a:b] for i, (a, b) in
                                 enumerate(zip(bounds[:-1], bounds[1:]))], axis=-1)
                for part in (0, 1))
  else:
    cos, sin = _cos_sin(positions, tables)
  cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
  sin = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x.dtype)


def _cos_sin(positions, tables: RopeTables):
  """cos and sin f32[b, s, d/2] of positions i32[b, s] x each inverse frequency."""
  fine = lambda t: jnp.asarray(t)[positions % ROPE_FINE]
  coarse = lambda t: jnp.take(jnp.asarray(t), positions // ROPE_FINE, axis=0, mode="fill",
                              fill_value=jnp.nan)
  cf, sf = fine(tables.fine_cos), fine(tables.fine_sin)
  cc, sc = coarse(tables.coarse_cos), coarse(tables.coarse_sin)
  return cc * cf - sc * sf, sc * cf + cc * sf
