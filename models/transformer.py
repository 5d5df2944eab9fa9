"""The decoder of the Qwen2, Qwen3, Llama 3, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Qwen2.5-VL
families (RMSNorm, RoPE, grouped-query or multi-head latent attention, SwiGLU, a mixture's
routed and shared experts, and a vision tower's rows in place of image tokens:
models/vision.py) as pure functions.

Owns the network: `init_params`, `forward` (packed training rows), `prefill` and `decode` (the
KV-cache passes of the engines' decoding programs, rollouts/decoding.py), the attention blocks,
the layer stack and the output projection. Its parts live beside it, as in MaxText's layers/:
RoPE in models/rope.py, a mixture's sparse block and routing in models/mixture.py, the
projections (quantization-aware dots, packed weights) and the MLP in models/projections.py.
Attention goes through models/attention/dispatch.py (the kernel named by
`ModelConfig.attention`; ring attention when the mesh set with `jax.set_mesh` has a `context`
axis), and so do decode steps, queries against the KV cache (`dispatch.cached_attention`).
Log-probs live in models/logprobs.py.

Parameter names follow Hugging Face's modules (q_proj, gate_proj, ...) so that the safetensors
import (models/hf.py) is a renaming plus transposes. `ModelConfig.remat` rematerialises each
layer in the backward pass with a named jax.checkpoint policy.

Low precision (models/quantize.py): `ModelConfig.weight_format` computes on the projections'
kernels rounded to that format (quantization-aware training); packed projections (an engine's
or a server's weights at rest) are dequantized on the fly at every pass.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import sharding as shd
from models import vision
from models.attention import dispatch, ring
from models.config import ModelConfig, YarnRope
from models.layers import RMSNorm
from models.mixture import MoE
from models.projections import MLP, on_tokens, projection, unpack_projections
from models.rope import rope, rope_tables


class KVCache(NamedTuple):
  """Keys and values, one array per layer: f32[batch, num_kv_heads, cache_len, head_dim].

  A decode step's attention reads this layout as it is; a stacked [layers, ...] array or
  slots before heads cost it a copy of the cache per layer (on CPU over a third of a step)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]


def init_cache(cfg: ModelConfig, batch: int, cache_len: int) -> KVCache:
  zeros = jnp.zeros((batch, cfg.num_kv_heads, cache_len, cfg.head_dim), cfg.compute_dtype)
  return KVCache((zeros,) * cfg.num_layers, (zeros,) * cfg.num_layers)


def _apply(params, cfg: ModelConfig, *args, **kwargs):
  """Decoder(cfg) on `params` (packed projections dequantized on the fly: unpack_projections)."""
  return Decoder(cfg).apply({"params": unpack_projections(params)}, *args, **kwargs)



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
  return on_tokens(projection(cfg, nn.DenseGeneral, cfg.hidden_size, axis=(-2, -1),
                               use_bias=False, dtype=cfg.compute_dtype,
                               param_dtype=cfg.param_dtype, name="o_proj"), out)


class Attention(nn.Module):
  """Grouped-query attention; the cache arguments as `_attend`'s. -> (out, cache)"""
  cfg: ModelConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, segment_ids, cache=None, cache_slot=None, kv_valid=None):
    cfg = self.cfg
    dense = lambda heads, name: projection(
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
    dense = lambda features, name: projection(
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
