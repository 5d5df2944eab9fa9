"""The decoder of the Qwen2, Qwen3, Llama 3, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Qwen2.5-VL
families (RMSNorm, RoPE, grouped-query or multi-head latent attention, SwiGLU, a mixture's
routed and shared experts, and a vision tower's rows in place of image tokens:
models/vision.py) as pure functions.

Owns the network: `init_params`, `forward` (packed training rows), `prefill` and `decode` (the
embedded engine's KV-cache passes), and the output projection. Attention goes through
models/attention/dispatch.py (the kernel named by `ModelConfig.attention`; ring attention when
the mesh set with `jax.set_mesh` has a `context` axis), and so do decode steps, queries
against the KV cache (`dispatch.cached_attention`). Log-probs live in
models/logprobs.py; sampling lives in rollouts/jax_engine.py.

RoPE reads constant cos/sin tables per config (`rope_tables`), which carry the config's frequency
scaling (linear, dynamic, yarn, llama3; models/config.py), so that the training forward and the
KV-cache passes rotate by the same angles.

Parameter names follow Hugging Face's modules (q_proj, gate_proj, ...) so that the safetensors
import (models/hf.py) is a renaming plus transposes. `ModelConfig.remat` rematerialises each
layer in the backward pass with a named jax.checkpoint policy.

A mixture's sparse layers (ModelConfig.moe) route each token to its top k experts and run
them dropless: the (token, expert) pairs sorted by expert through grouped matrix products
(`dropless_experts`, jax.lax.ragged_dot); the experts' weights are stacked [E, in, out].

Low precision (models/quantize.py): `ModelConfig.weight_format` computes on the projections'
kernels rounded to that format (quantization-aware training); `pack_projections` holds them in
it (an engine's or a server's weights at rest), and every pass dequantizes such params on the
fly (`unpack_projections`).
"""

import functools
import math

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import quantize
from models import sharding as shd
from models import vision
from models.attention import dispatch, ring
from models.layers import RMSNorm, swiglu
from models.config import (DynamicRope, Llama3Rope, LinearRope, ModelConfig, MoeConfig,
                           RopeScaling, YarnRope)


class KVCache(NamedTuple):
  """Keys and values, one array per layer: f32[batch, num_kv_heads, cache_len, head_dim].

  A decode step's attention reads this layout as it is; a stacked [layers, ...] array or
  slots before heads cost it a copy of the cache per layer (on CPU over a third of a step)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]


def init_cache(cfg: ModelConfig, batch: int, cache_len: int) -> KVCache:
  zeros = jnp.zeros((batch, cfg.num_kv_heads, cache_len, cfg.head_dim), cfg.compute_dtype)
  return KVCache((zeros,) * cfg.num_layers, (zeros,) * cfg.num_layers)


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


def on_tokens(layer, x):
  """layer(x) with x's rows and sequence [rows, seq, ...] merged into one axis of tokens.

  A projection's weight gradient contracts over every token; given rows and sequence as two
  contracting axes, XLA:CPU lays its operands out transposed first, and those strided copies
  took ~40% of the MLP's backward pass (bench/peers.py).
  """
  rows, seq = x.shape[:2]
  y = layer(x.reshape(rows * seq, *x.shape[2:]))
  return y.reshape(rows, seq, *y.shape[1:])


@functools.cache
def _rounded_dot(fmt: str):
  """A dot_general for flax's Dense / DenseGeneral whose kernel (its right operand, input
  dims first) is rounded to weight format `fmt` as the checkpoint's [out, in] matrix
  (models/quantize.py), with straight-through gradients."""
  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    (_, contracted), _ = dimension_numbers
    if tuple(contracted) != tuple(range(len(contracted))):
      raise ValueError(f"weight_format: a kernel contracted over dims {contracted}, not its "
                       "leading ones")
    matrix = quantize.kernel_matrix(rhs, len(contracted))
    rhs = quantize.fake_quantize(matrix, fmt).T.reshape(rhs.shape)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  return dot_general


def projection_inputs(path) -> int | None:
  """How many leading (input) dims the kernel at params `path` (its keys) contracts, when it
  is a decoder layer's projection (what a quantized checkpoint stores quantized), else None."""
  if not (path[0].startswith("layers_") and path[-1] == "kernel"
          and path[-2].endswith(("_proj", "_proj_with_mqa"))):
    return None
  return 2 if path[-2] == "o_proj" else 1  # o_proj's kernel is [heads, head_dim, hidden]


def pack_projections(params, fmt: str):
  """`params` with every decoder layer's projection kernel held in weight format `fmt`
  (quantize.Packed): an engine's weights at rest, as a quantized checkpoint stores them."""
  def maybe_pack(path, x):
    inputs = projection_inputs(tuple(k.key for k in path))
    return x if inputs is None else quantize.pack(x, fmt, inputs)
  return jax.tree_util.tree_map_with_path(maybe_pack, params)


def unpack_projections(params):
  """`params` with every quantize.Packed kernel dequantized (the others as they are)."""
  is_packed = lambda x: isinstance(x, quantize.Packed)
  return jax.tree.map(lambda x: quantize.unpack(x) if is_packed(x) else x, params,
                      is_leaf=is_packed)


def _apply(params, cfg: ModelConfig, *args, **kwargs):
  """Decoder(cfg) on `params` (packed projections dequantized on the fly: unpack_projections)."""
  return Decoder(cfg).apply({"params": unpack_projections(params)}, *args, **kwargs)


def _projection(cfg: ModelConfig, module, *args, **kwargs):
  """`module(*args, **kwargs)` (nn.Dense or nn.DenseGeneral), computing on its weights rounded
  to cfg.weight_format when it has one."""
  if cfg.weight_format is not None:
    kwargs["dot_general"] = _rounded_dot(cfg.weight_format)
  return module(*args, **kwargs)


def _attend(cfg: ModelConfig, layer: int, q, k, v, segment_ids, cache, cache_slot, kv_valid):
  """Attention of q [b, s, heads, d] over k, v [b, s, kv_heads, d], through o_proj's input
  -> (out [b, s, heads, d], cache). Without a cache: causal within segments. With the
  KVCache of all layers: this layer's k, v are written at slots [cache_slot, cache_slot +
  seq) of its arrays (in place, so a decode loop copies nothing); then with `kv_valid`
  (decode) the queries attend to the whole cache, without it (prefill, slot 0) to the
  written tokens only."""
  if cache is not None:
    def write(layers, new):
      old = layers[layer]
      new = jax.lax.dynamic_update_slice(old, new.transpose(0, 2, 1, 3).astype(old.dtype),
                                         (0, 0, cache_slot, 0))
      return layers[:layer] + (new,) + layers[layer + 1:]

    cache = KVCache(write(cache.k, k), write(cache.v, v))
  if kv_valid is not None:
    return dispatch.cached_attention(q, cache.k[layer], cache.v[layer], kv_valid, cache_slot,
                                     kernel=cfg.attention), cache
  return dispatch.attention(q, k, v, segment_ids, kernel=cfg.attention), cache


def _output(cfg: ModelConfig, out):
  """o_proj: [b, s, heads, d] -> [b, s, hidden]."""
  return on_tokens(_projection(cfg, nn.DenseGeneral, cfg.hidden_size, axis=(-2, -1),
                               use_bias=False, dtype=cfg.compute_dtype,
                               param_dtype=cfg.param_dtype, name="o_proj"), out)


class Attention(nn.Module):
  """Grouped-query attention; the cache arguments as `_attend`'s. -> (out, cache)"""
  cfg: ModelConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache=None, cache_slot=None, kv_valid=None):
    cfg = self.cfg
    dense = lambda heads, name: _projection(
        cfg, nn.DenseGeneral, (heads, cfg.head_dim), use_bias=cfg.qkv_bias,
        dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype, name=name)
    q = shd.constrain(on_tokens(dense(cfg.num_heads, "q_proj"), x), shd.BATCH, shd.SEQ,
                      shd.ACT_HEADS, None)
    k, v = (shd.constrain(on_tokens(dense(cfg.num_kv_heads, name), x), shd.BATCH, shd.SEQ,
                          shd.ACT_KV_HEADS, None) for name in ("k_proj", "v_proj"))
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
      q = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, name="q_norm")(q)
      k = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, name="k_norm")(k)
    tables = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q, k = (rope(y, positions, tables, cfg.mrope_section) for y in (q, k))
    out, cache = _attend(cfg, self.layer, q, k, v, segment_ids, cache, cache_slot, kv_valid)
    return _output(cfg, out), cache


class LatentAttention(nn.Module):
  """DeepSeek-V3's multi-head latent attention (MlaConfig), expanded per head: each head's
  query and key are [nope dims, rope dims], its value zero-padded to the same width, so that
  the kernels and the KV cache take them as Attention's (the latent cache of an MLA engine is
  not built). The cache arguments as `_attend`'s. -> (out, cache)"""
  cfg: ModelConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache=None, cache_slot=None, kv_valid=None):
    cfg, m = self.cfg, self.cfg.mla
    nope = cfg.head_dim - m.rope_dim
    dense = lambda features, name: _projection(
        cfg, nn.DenseGeneral, features, use_bias=False, dtype=cfg.compute_dtype,
        param_dtype=cfg.param_dtype, name=name)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, name=name)
    query = (cfg.num_heads, cfg.head_dim)
    if m.q_rank is None:
      q = on_tokens(dense(query, "q_proj"), x)
    else:
      q = on_tokens(dense(query, "q_b_proj"),
                    norm("q_a_layernorm")(on_tokens(dense(m.q_rank, "q_a_proj"), x)))
    latent = on_tokens(dense(m.kv_rank + m.rope_dim, "kv_a_proj_with_mqa"), x)
    kv = on_tokens(dense((cfg.num_heads, nope + m.value_dim), "kv_b_proj"),
                   norm("kv_a_layernorm")(latent[..., :m.kv_rank]))
    tables = rope_tables(m.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    # Interleaved pairs gathered into halves (q and k alike, so q.k is unchanged): then
    # `rope` rotates them as transformers' apply_rotary_pos_emb_interleave does.
    halves = ((lambda a: jnp.concatenate([a[..., 0::2], a[..., 1::2]], -1))
              if m.rope_interleave else (lambda a: a))
    rotated = lambda a: rope(halves(a), positions, tables)
    shared = rotated(latent[:, :, None, m.kv_rank:])  # [b, s, 1, rope_dim]: every head's
    scale = (cfg.rope_scaling.softmax_scale() if isinstance(cfg.rope_scaling, YarnRope)
             else 1.0)
    q = jnp.concatenate([q[..., :nope], rotated(q[..., nope:])], -1)
    q = q * jnp.asarray(scale, q.dtype) if scale != 1.0 else q
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(shared, (*kv.shape[:3], m.rope_dim))],
                        -1)
    v = jnp.pad(kv[..., nope:], [(0, 0)] * 3 + [(0, cfg.head_dim - m.value_dim)])
    q, k, v = (shd.constrain(a, shd.BATCH, shd.SEQ, shd.ACT_HEADS, None) for a in (q, k, v))
    out, cache = _attend(cfg, self.layer, q, k, v, segment_ids, cache, cache_slot, kv_valid)
    return _output(cfg, out[..., :m.value_dim]), cache


class MLP(nn.Module):
  """The SwiGLU MLP, of width `size` (default cfg.intermediate_size)."""
  cfg: ModelConfig
  size: int | None = None

  @nn.compact
  def __call__(self, x):
    dense = lambda size, name: _projection(
        self.cfg, nn.Dense, size, use_bias=False, dtype=self.cfg.compute_dtype,
        param_dtype=self.cfg.param_dtype, name=name)
    size = self.size or self.cfg.intermediate_size
    hidden = swiglu(on_tokens(dense(size, "gate_proj"), x),
                    on_tokens(dense(size, "up_proj"), x))
    hidden = shd.constrain(hidden, shd.BATCH, shd.SEQ, shd.ACT_MLP)
    return on_tokens(dense(self.cfg.hidden_size, "down_proj"), hidden)


def dropless_experts(x, experts, weights, gate, up, down):
  """Each token through its k experts, none dropped: the (token, expert) pairs sorted by
  expert and run as grouped matrix products (`jax.lax.ragged_dot`), then put back and summed
  with their weights in float32.

  x [T, H]; experts i32[T, k]; weights [T, k]; gate, up [E, H, I]; down [E, I, H] -> [T, H]
  """
  tokens, k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=gate.shape[0])
  xs = x[order // k]  # [T * k, H], grouped by expert
  hidden = swiglu(jax.lax.ragged_dot(xs, gate, sizes), jax.lax.ragged_dot(xs, up, sizes))
  out = jax.lax.ragged_dot(hidden, down, sizes)
  out = out[jnp.argsort(order)].reshape(tokens, k, -1)  # back to (token, slot) order
  return jnp.einsum("tkh,tk->th", out.astype(jnp.float32),
                    weights.astype(jnp.float32)).astype(x.dtype)


def queue_slots(queues, num_queues: int, room: int):
  """Each item's place in its queue, items queued in order, `room` for those past the room.

  queues i32[N] each item's queue in [0, num_queues) -> i32[N]
  """
  order = jnp.argsort(queues, stable=True)
  sizes = jnp.bincount(queues, length=num_queues)
  starts = jnp.cumsum(sizes) - sizes
  slot = jnp.zeros_like(queues).at[order].set(jnp.arange(queues.size) - starts[queues[order]])
  return jnp.where(slot < room, slot, room)


def capacity_experts(x, experts, weights, gate, up, down, capacity: int):
  """dropless_experts with room for `capacity` (token, expert) pairs an expert (GShard's
  capacity factor): each expert's pairs, in token order, fill its [capacity, H] buffer and
  those past it are dropped (they add nothing; the token keeps its other experts and the
  residual). The experts then run as one batched product over [E, capacity, H], capacity /
  (T k / E) times the FLOPs of the pairs, where a backend without grouped products (XLA:CPU
  masks every group over all rows) computes dropless_experts at E times. Equal to
  dropless_experts when no expert gets more than `capacity` pairs.

  x [T, H]; experts i32[T, k]; weights [T, k]; gate, up [E, H, I]; down [E, I, H] -> [T, H]
  """
  tokens, k = experts.shape
  num_experts = gate.shape[0]
  flat = experts.reshape(-1)
  # Past the capacity a pair lands out of bounds: the scatter drops it, the gather reads 0.
  slot = queue_slots(flat, num_experts, capacity)
  xs = jnp.zeros((num_experts, capacity, x.shape[1]), x.dtype)
  xs = xs.at[flat, slot].set(jnp.repeat(x, k, axis=0), mode="drop")
  hidden = swiglu(jnp.einsum("ech,ehi->eci", xs, gate), jnp.einsum("ech,ehi->eci", xs, up))
  out = jnp.einsum("eci,eih->ech", hidden, down)
  out = out.at[flat, slot].get(mode="fill", fill_value=0).reshape(tokens, k, -1)
  return jnp.einsum("tkh,tk->th", out.astype(jnp.float32),
                    weights.astype(jnp.float32)).astype(x.dtype)


EXPERT_AXIS = "expert"


def _exchange_pairs(x, experts, groups: int, per_group: int, room: int):
  """The (token, expert) pairs of `experts` i32[T, k] laid out for an all-to-all over `groups`
  devices holding `per_group` experts each: -> (to i32[T * k] each pair's device, slot
  i32[T * k] its place in that device's buffer, `room` where it is dropped, send [groups,
  room, H] the tokens, ids i32[groups, room] each one's expert on its device, `per_group`
  where the slot is empty)."""
  flat = experts.reshape(-1)
  to, local = flat // per_group, flat % per_group
  slot = queue_slots(to, groups, room)
  send = jnp.zeros((groups, room, x.shape[1]), x.dtype).at[to, slot].set(
      jnp.repeat(x, experts.shape[1], axis=0), mode="drop")
  ids = jnp.full((groups, room), per_group, jnp.int32).at[to, slot].set(local, mode="drop")
  return to, slot, send, ids


def expert_parallel_experts(x, experts, weights, gate, up, down,
                            capacity_factor: float | None = None):
  """dropless_experts (capacity_factor None) on a mesh with an `expert` axis of P devices, each
  holding E / P of the experts: every device sends each of its (token, expert) pairs to the
  device holding that expert (all-to-all inside shard_map), which runs its experts on what it
  received as grouped matrix products and sends the results back to be summed with the
  weights. Tokens are split over the mesh as activations are (rows over data, fsdp and
  expert, the sequence over context); an expert's MLP columns over tensor (a partial sum,
  added up over tensor); the fsdp-split weights are gathered as every layer's are.

  The buffers exchanged are fixed in size: room for all of a device's T_local * k pairs at
  every destination (nothing dropped whatever the routing), or with a capacity factor f room
  for ceil(f * T_local * k / P) pairs from each peer, the overflow dropped in token order;
  the receiver then runs its experts as capacity_experts does, each with room for
  ceil(f * T_local * k / E_local) of the pairs it received, in (sender, slot) order (what
  capacity_experts gives each expert over the P devices' tokens), as one batched product
  (no grouped products: XLA:CPU lowers those over every group).

  x [rows, seq, H]; experts i32[rows, seq, k]; weights [rows, seq, k]; gate, up [E, H, I];
  down [E, I, H] -> [rows, seq, H]
  """
  mesh = jax.sharding.get_abstract_mesh()
  groups = mesh.shape[EXPERT_AXIS]
  if gate.shape[0] % groups:
    raise ValueError(f"expert parallelism: {gate.shape[0]} experts do not split over the "
                     f"mesh's expert axis of {groups} devices")
  tokens = shd.spec((shd.BATCH, shd.SEQ, None), x.shape, mesh)
  w_in = shd.spec((shd.EXPERTS, None, shd.MLP), gate.shape, mesh)
  w_out = shd.spec((shd.EXPERTS, shd.MLP, None), down.shape, mesh)
  split_columns = w_in[2] is not None

  def per_device(x, experts, weights, gate, up, down):
    rows, seq, hidden = x.shape
    x, experts = x.reshape(-1, hidden), experts.reshape(rows * seq, -1)
    per_group = gate.shape[0]
    room = (experts.size if capacity_factor is None
            else math.ceil(capacity_factor * experts.size / groups))
    to, slot, send, ids = _exchange_pairs(x, experts, groups, per_group, room)
    received = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True).reshape(-1, hidden)
    got = jax.lax.all_to_all(ids, EXPERT_AXIS, 0, 0, tiled=True).reshape(-1)
    # Empty slots name expert `per_group`, none of this device's: both drop them (zero rows).
    one_each = (received, got[:, None], jnp.ones((got.size, 1), x.dtype), gate, up, down)
    if capacity_factor is None:
      out = dropless_experts(*one_each)
    else:
      out = capacity_experts(*one_each,
                             capacity=math.ceil(capacity_factor * experts.size / per_group))
    out = out.reshape(groups, room, hidden)
    back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)
    pairs = back.at[to, slot].get(mode="fill", fill_value=0).reshape(*experts.shape, hidden)
    summed = jnp.einsum("tkh,tk->th", pairs.astype(jnp.float32),
                        weights.reshape(experts.shape).astype(jnp.float32))
    if split_columns:
      summed = jax.lax.psum(summed, "tensor")
    return summed.astype(x.dtype).reshape(rows, seq, hidden)

  return jax.shard_map(per_device, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
                       out_specs=tokens)(x, experts, weights, gate, up, down)


def _expert_parallel() -> bool:
  """Whether the mesh being traced under has an `expert` axis (of more than one device)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.shape.get(EXPERT_AXIS, 1) > 1


class Route(NamedTuple):
  """Where a mixture's sparse layers sent each token: per layer (axis 2 of a model's Route,
  absent of one layer's) `experts` i32[rows, seq, (layers,) k] the experts it went to,
  `native` the router's own top k (the same without replay), `entropy` f32[rows, seq,
  (layers)] of the router's scores normalised over all experts, `balance` f32[rows, seq,
  (layers)] the token's term of the load-balancing loss (`balance_loss`)."""
  experts: jax.Array
  native: jax.Array
  entropy: jax.Array
  balance: jax.Array


def balance_terms(probs, native, real, num_experts: int):
  """Each token's term of the Switch Transformer's load-balancing loss, E * sum_e f_e p_e:
  `probs` f32[T, E] its router's scores normalised over the experts, f_e the share of the
  (token, slot) pairs of the `real` (f32[T], 1 for a token that counts) tokens whose router
  chose e (`native` i32[T, k]; no gradient: the choice has none) -> f32[T]. Their mean over
  the real tokens is the loss: 1 when the load and the scores are uniform, more as both
  gather on the same experts."""
  k = native.shape[1]
  load = jnp.bincount(native.reshape(-1), weights=jnp.repeat(real, k), length=num_experts)
  share = jax.lax.stop_gradient(load / jnp.maximum(k * jnp.sum(real), 1.0))
  return num_experts * probs @ share


def balance_loss(route: Route, mask):
  """The load-balancing auxiliary loss of a model's Route (layer axis 2) over the tokens
  `mask` (bool[rows, seq]) marks, the mean over sparse layers of each one's (balance_terms;
  transformers' Qwen3-MoE load_balancing_loss_func gives k times it for one sparse layer,
  and pools the tokens of all layers where this averages the layers' losses)."""
  m = mask.astype(jnp.float32)[:, :, None]
  return jnp.sum(route.balance * m) / (jnp.maximum(jnp.sum(m), 1.0) * route.balance.shape[2])


def expert_counts(route: Route, mask, num_experts: int):
  """f32[sparse layers, E]: the tokens `mask` (bool[rows, seq]) marks that each layer sent to
  each expert, from a model's Route (layer axis 2)."""
  k = route.experts.shape[3]
  weights = jnp.broadcast_to(mask.astype(jnp.float32)[:, :, None], mask.shape + (k,))
  return jax.vmap(lambda e: jnp.bincount(e.reshape(-1), weights=weights.reshape(-1),
                                         length=num_experts), in_axes=2)(route.experts)


def balance_experts(params, cfg: ModelConfig, counts, rate: float):
  """DeepSeek-V3's loss-free balancing: `params` with each sparse layer's correction bias
  moved by `rate` against its load, b_e += rate * sign(mean load - load_e) (`counts`
  f32[sparse layers, E], expert_counts summed over a step): an expert that took more tokens
  than the mean is chosen less often after, one that took fewer more often."""
  params = dict(params)
  for j, layer in enumerate(cfg.sparse_layers):
    name = f"layers_{layer}"
    mlp = dict(params[name]["mlp"])
    load = counts[j]
    mlp["e_score_correction_bias"] = mlp["e_score_correction_bias"] + rate * jnp.sign(
        jnp.mean(load) - load)
    params[name] = {**params[name], "mlp": mlp}
  return params


def routing_metrics(route: Route, mask, num_experts: int, engine=None) -> dict[str, jax.Array]:
  """A mixture's routing over the tokens `mask` (bool[rows, seq]) marks, from a model's Route
  (layer axis 2), each a mean over the sparse layers:
  expert_load_cv: the coefficient of variation of the assignments each expert got (0 when
    balanced, sqrt(E - 1) when one expert takes all);
  expert_load_max: the largest share of a layer's assignments one expert took, times E (1 when
    balanced: a collapse shows as E / k or more);
  router_entropy: of the router's scores normalised over all experts (Qwen3-MoE's softmax),
    per token;
  expert_balance_loss: the load-balancing loss (balance_loss; 1 when balanced).
  With `engine` i32[rows, seq, sparse layers, k], the experts the engine chose (negative: not
  recorded), over the masked tokens it recorded, the share of tokens whose experts (as a set)
  are not the engine's in at least one sparse layer:
  routing_differs: the experts the token went to (0 under routing replay);
  router_differs: the router's own top k (what it would have been without replay)."""
  m = mask.astype(jnp.float32)
  layers = route.experts.shape[2]
  counts = expert_counts(route, mask, num_experts)
  total = jnp.maximum(jnp.sum(counts, axis=-1), 1.0)
  mean = total / num_experts
  out = {"expert_load_cv": jnp.mean(jnp.std(counts, axis=-1) / mean),
         "expert_load_max": jnp.mean(jnp.max(counts, axis=-1) / mean),
         "router_entropy": jnp.sum(route.entropy * m[:, :, None]) / (
             jnp.maximum(jnp.sum(m), 1.0) * layers),
         "expert_balance_loss": balance_loss(route, mask)}
  if engine is not None:
    recorded = m * jnp.all(engine >= 0, axis=(2, 3))
    tokens = jnp.maximum(jnp.sum(recorded), 1.0)
    engine = jnp.sort(engine, axis=-1)
    share = lambda experts: jnp.sum(jnp.any(jnp.sort(experts, axis=-1) != engine, (2, 3))
                                    * recorded) / tokens
    out["routing_differs"] = share(route.experts)
    out["router_differs"] = share(route.native)
  return out


def router_scores(logits, moe: MoeConfig, bias=None):
  """(scores f32[T, E], the router's own top k i32[T, k]) from router logits [T, E]: the
  softmax over the experts or each one's sigmoid (MoeConfig.scoring); the k chosen by the
  scores plus `bias` f32[E] (DeepSeek-V3's correction bias, for choosing only) among the
  experts of the MoeConfig.top_groups groups whose two best biased scores sum highest, as
  transformers' Qwen3MoeTopKRouter and DeepseekV3TopkRouter choose them."""
  logits = logits.astype(jnp.float32)
  scores = (jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax"
            else jax.nn.sigmoid(logits))
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if moe.groups > 1:
    grouped = choice.reshape(choice.shape[0], moe.groups, -1)
    best = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)  # [T, G]
    kept = jax.nn.one_hot(jax.lax.top_k(best, moe.top_groups)[1], moe.groups).sum(-2) > 0
    choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(choice.shape)
  return scores, jax.lax.top_k(choice, moe.experts_per_token)[1]


def route_weights(scores, experts, moe: MoeConfig):
  """The k gate weights f32[T, k] of `experts` i32[T, k]: their scores, renormalised to sum
  to 1 when MoeConfig.normalize_weights, times MoeConfig.scaling."""
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if moe.normalize_weights:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * moe.scaling


class MoE(nn.Module):
  """A sparse block: a router (`gate`, no bias) picks each token's top k experts by its
  scores in float32 (router_scores: Qwen3-MoE's softmax, or DeepSeek-V3's sigmoid with a
  correction bias and groups), their weights (route_weights) cast back to the router's dtype;
  each expert a SwiGLU of width MoeConfig.expert_size, run dropless or, with
  MoeConfig.capacity_factor, with room for so many tokens an expert (capacity_experts); plus
  DeepSeek-V3's shared experts (or Qwen2-MoE's gated one) when MoeConfig.shared_size.

  `replay` i32[rows, seq, k] (rollout routing replay): the experts each token goes to, as the
  engine chose them, its weights the trainer's scores at those experts; a row with a negative
  id routes natively. `real` bool[rows, seq]: the tokens the load-balancing loss counts
  (default all). Returns (out, Route)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, replay=None, real=None):
    cfg, moe = self.cfg, self.cfg.moe
    rows, seq, hidden = x.shape
    tokens = x.reshape(rows * seq, hidden)
    logits = nn.Dense(moe.num_experts, use_bias=False, dtype=cfg.compute_dtype,
                      param_dtype=cfg.param_dtype, name="gate")(tokens)
    # Not trained by gradient (the choice it shifts has none): loss-free balancing moves it.
    bias = self.param("e_score_correction_bias", nn.initializers.zeros, (moe.num_experts,),
                      jnp.float32) if moe.correction_bias else None
    scores, native = router_scores(logits, moe, bias)
    experts = native
    if replay is not None:
      replay = replay.reshape(rows * seq, -1)
      experts = jnp.where(jnp.all(replay >= 0, axis=-1, keepdims=True), replay, native)
    weights = route_weights(scores, experts, moe)
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    expert = lambda name, shape: self.param(name, init, (moe.num_experts, *shape),
                                            cfg.param_dtype).astype(cfg.compute_dtype)
    weights_of = (expert("experts_gate_proj", (hidden, moe.expert_size)),
                  expert("experts_up_proj", (hidden, moe.expert_size)),
                  expert("experts_down_proj", (moe.expert_size, hidden)))
    if _expert_parallel():
      tokens_of = lambda a: a.reshape(rows, seq, -1)
      out = expert_parallel_experts(x, tokens_of(experts), tokens_of(weights.astype(logits.dtype)),
                                    *weights_of, capacity_factor=moe.capacity_factor)
      out = out.reshape(tokens.shape)
    elif moe.capacity_factor is None:
      out = dropless_experts(tokens, experts, weights.astype(logits.dtype), *weights_of)
    else:
      out = capacity_experts(tokens, experts, weights.astype(logits.dtype), *weights_of,
                             capacity=moe.capacity(rows * seq))
    if moe.shared_size:
      shared = MLP(cfg, moe.shared_size, name="shared_experts")(x).reshape(tokens.shape)
      if moe.shared_gate:  # Qwen2-MoE's: sigmoid(x . w) per token
        shared = shared * jax.nn.sigmoid(nn.Dense(1, use_bias=False, dtype=cfg.compute_dtype,
                                                  param_dtype=cfg.param_dtype,
                                                  name="shared_expert_gate")(tokens))
      out = out + shared
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    real = (jnp.ones((rows * seq,), jnp.float32) if real is None
            else real.reshape(-1).astype(jnp.float32))
    balance = balance_terms(probs, native, real, moe.num_experts)
    shaped = lambda a: a.reshape(rows, seq, *a.shape[1:])
    return out.reshape(rows, seq, hidden), Route(shaped(experts), shaped(native),
                                                 shaped(entropy), shaped(balance))


class Block(nn.Module):
  cfg: ModelConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache=None, cache_slot=None, kv_valid=None,
               replay=None):
    """-> (x, cache, the sparse layer's Route or None); `replay`: MoE's."""
    norm = lambda name: RMSNorm(self.cfg.rms_norm_eps, self.cfg.param_dtype, name=name)
    attention = Attention if self.cfg.mla is None else LatentAttention
    h, cache = attention(self.cfg, self.layer, name="self_attn")(
        norm("input_layernorm")(x), positions, segment_ids, cache, cache_slot, kv_valid)
    x = x + h
    h, route = norm("post_attention_layernorm")(x), None
    if self.cfg.sparse(self.layer):
      real = None if segment_ids is None else segment_ids > 0
      h, route = MoE(self.cfg, name="mlp")(h, replay, real)
    else:
      h = MLP(self.cfg, name="mlp")(h)
    return shd.constrain(x + h, shd.BATCH, shd.SEQ, shd.ACT_EMBED), cache, route


_REMAT = {"full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def alike_runs(cfg: ModelConfig) -> list[range]:
  """The decoder's layers in runs of consecutive layers alike (all dense or all sparse)."""
  runs = []
  for layer in range(cfg.num_layers):
    if runs and cfg.sparse(runs[-1][0]) == cfg.sparse(layer):
      runs[-1] = range(runs[-1][0], layer + 1)
    else:
      runs.append(range(layer, layer + 1))
  return runs


def scan_layers(cfg: ModelConfig, first: int, layer_params: list, x, positions, segment_ids,
                replay=None):
  """Blocks alike (an alike_runs run from layer `first`) as one lax.scan over their stacked
  parameters, each rematerialised with the policy `cfg.remat`: x f32[rows, seq, hidden] ->
  (the last block's output, the layers' Route stacked on axis 2 or None); `replay` [rows,
  seq, layers, k] as Decoder's.

  Why a scan: XLA:CPU drops jax.checkpoint's optimization barriers and then merges the
  backward pass's recomputation with the forward pass, so over an unrolled stack of layers
  checkpointing saves nothing (the compiled step of bench/peers.py kept 1.39 GiB of
  temporaries with every policy). Across the iterations of a loop nothing merges, on any
  backend. The price is a stacked copy of the layers' weights and of their gradients per step
  (2 x 90 MB in that step, against 0.95 GiB of activations saved).
  """
  stacked = jax.tree.map(lambda *w: jnp.stack(w), *layer_params)

  def one_layer(x, params_and_replay):
    params, replay = params_and_replay
    # parent=None: a free-standing module even when called from inside Decoder's methods.
    x, _, route = Block(cfg, first, parent=None).apply({"params": params}, x, positions,
                                                       segment_ids, replay=replay)
    return x, route

  one_layer = jax.checkpoint(one_layer, policy=_REMAT[cfg.remat], prevent_cse=False)
  replays = None if replay is None else jnp.moveaxis(replay, 2, 0)
  x, routes = jax.lax.scan(one_layer, x, (stacked, replays))
  return x, None if routes is None else jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2), routes)


class Decoder(nn.Module):
  """Embeddings, blocks and final norm; returns final hidden states (the head is separate)."""
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size,
                                 embedding_init=nn.initializers.normal(0.02),
                                 param_dtype=cfg.param_dtype)
    self.layers = [Block(cfg, i) for i in range(cfg.num_layers)]  # named layers_0, layers_1...
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype)
    if cfg.vision is not None:
      self.visual = vision.VisionTower(cfg.vision, cfg.dtype, cfg.param_dtype)
    if not cfg.tie_embeddings:
      # Declared here so init creates it; applied by `output_projection`.
      self.lm_head = self.param("lm_head", nn.initializers.normal(0.02),
                                (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype)

  def __call__(self, tokens, positions, segment_ids, cache=None, cache_slot=None, kv_valid=None,
               replay=None, images: vision.Images | None = None):
    """-> (final hidden states, cache, the sparse layers' Route stacked on axis 2 or None).
    `replay` i32[rows, seq, sparse layers, k]: each sparse layer's MoE replay. `images`: the
    vision tower's rows replace the embeddings of the tokens at their slots."""
    cfg = self.cfg
    x = self.embed_tokens(tokens).astype(cfg.compute_dtype)
    if images is not None:
      x = self._with_images(x, images)
    x = shd.constrain(x, shd.BATCH, shd.SEQ, shd.ACT_EMBED)
    if cfg.remat != "none" and cache is None and not self.is_initializing():
      params, routes, sparse = self.variables["params"], [], 0  # sparse layers so far
      for run in alike_runs(cfg):  # e.g. DeepSeek's dense first layers, then the sparse ones
        taken = None
        if replay is not None and cfg.sparse(run[0]):
          taken, sparse = replay[:, :, sparse:sparse + len(run)], sparse + len(run)
        x, run_routes = scan_layers(cfg, run[0], [params[f"layers_{i}"] for i in run], x,
                                    positions, segment_ids, taken)
        routes += [] if run_routes is None else [run_routes]
      joined = jax.tree.map(lambda *a: jnp.concatenate(a, axis=2), *routes) if routes else None
      return self.norm(x), cache, joined
    routes = []
    for layer in self.layers:
      one = None if replay is None or not cfg.sparse(layer.layer) else replay[:, :, len(routes)]
      x, cache, route = layer(x, positions, segment_ids, cache, cache_slot, kv_valid, one)
      if route is not None:
        routes.append(route)
    stacked = jax.tree.map(lambda *a: jnp.stack(a, axis=2), *routes) if routes else None
    return self.norm(x), cache, stacked


  def _with_images(self, x, images: vision.Images):
    """x [rows, seq, hidden] with the tokens at images.slots replaced by the tower's rows."""
    if self.cfg.vision is None:
      raise ValueError(f"images given to a {self.cfg.family} model, which has no vision tower")
    rows = self.visual(images).astype(x.dtype)  # [patches / merge, hidden], row after row
    slots = images.slots
    if slots.ndim == 2:  # each row's own: indices into the tokens of its row
      slots = slots + x.shape[1] * jnp.arange(slots.shape[0])[:, None]
    flat = x.reshape(-1, x.shape[-1]).at[slots.reshape(-1)].set(rows, mode="drop")
    return flat.reshape(x.shape)


def init_params(cfg: ModelConfig, key: jax.Array):
  """Random parameters (in cfg.param_dtype) for `cfg`."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  images = None
  if cfg.vision is not None:  # one image of one merge block
    m = cfg.vision.spatial_merge_size
    one = vision.PatchedImage(np.zeros((m * m, cfg.vision.patch_dim), np.float32), (1, m, m))
    images = vision.batch_images([one], cfg.vision, [0])
  return Decoder(cfg).init(key, tokens, tokens, jnp.ones((1, 2), jnp.int32),
                           images=images)["params"]


def forward(params, cfg: ModelConfig, tokens, positions, segment_ids,
            images: vision.Images | None = None):
  """Hidden states of packed rows.

  tokens, positions, segment_ids: i32[rows, seq] (segment 0 = padding; positions
  i32[rows, seq, 3] for multimodal RoPE) -> f32[rows, seq, hidden]. `images`: the rows'
  images (models.vision.Images, whose slots say which tokens each replaces), for a model
  with a vision tower.

  Under a mesh with a `context` axis of size C > 1 the rows run in ring attention's zigzag
  order (padded to a multiple of 2C); the result is in the original order.
  """
  return forward_with_routes(params, cfg, tokens, positions, segment_ids, images=images)[0]


def forward_with_routes(params, cfg: ModelConfig, tokens, positions, segment_ids, replay=None,
                        images: vision.Images | None = None):
  """`forward`, and where a mixture's sparse layers sent each token: (f32[rows, seq, hidden],
  Route with a layer axis 2, or None for a dense model). `replay` i32[rows, seq, sparse
  layers, k]: the experts each token goes to (rollout routing replay; a row of negative ids
  routes natively)."""
  context = ring.context_size()
  seq = tokens.shape[1]
  if context > 1 and images is not None:
    raise ValueError("images under a mesh with a `context` axis: context parallelism does not "
                     "take a vision tower yet")
  if context > 1:
    tokens, positions, segment_ids = (ring.to_zigzag(x, context)
                                      for x in (tokens, positions, segment_ids))
    replay = None if replay is None else ring.to_zigzag(replay, context)
  hidden, _, routes = _apply(params, cfg, tokens, positions, segment_ids, replay=replay,
                             images=images)
  if context > 1:
    hidden, routes = jax.tree.map(lambda a: ring.from_zigzag(a, seq, context), (hidden, routes))
  return hidden.astype(jnp.float32), routes


def prefill(params, cfg: ModelConfig, tokens, positions, segment_ids, cache: KVCache,
            images: vision.Images | None = None):
  """Run prompts and write their keys and values at cache slots [0, prompt_len).

  tokens, positions, segment_ids: i32[batch, prompt_len] (left padding has segment 0;
  positions i32[batch, prompt_len, 3] for multimodal RoPE); `images` the prompts' images
  (their slots in the flattened tokens) -> (f32[batch, prompt_len, hidden], updated KVCache, a
  mixture's Route of the prompt tokens or None)
  """
  if ring.context_size() > 1:
    raise ValueError("prefill runs on one device's rows; call it outside a mesh with a "
                     "`context` axis (the engine is not context-parallel)")
  hidden, cache, routes = _apply(params, cfg, tokens, positions, segment_ids, cache, 0,
                                 images=images)
  return hidden.astype(jnp.float32), cache, routes


def decode(params, cfg: ModelConfig, tokens, positions, kv_valid, cache: KVCache, cache_slot):
  """Run `tokens` written at cache slots [cache_slot, cache_slot + q_len) against the cache.

  tokens, positions: i32[batch, q_len]; kv_valid: bool[batch, cache_len] (after this write)
  -> (f32[batch, q_len, hidden], updated KVCache, a mixture's Route of `tokens` or None)
  """
  hidden, cache, routes = _apply(params, cfg, tokens, positions, None, cache, cache_slot,
                                 kv_valid)
  return hidden.astype(jnp.float32), cache, routes


def output_projection(params, cfg: ModelConfig):
  """The unembedding matrix f32[hidden, vocab] (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embed_tokens"]["embedding"].T
  return params["lm_head"]
