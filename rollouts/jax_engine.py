"""The embedded JAX engine: batched sampling with a KV cache, in the trainer's process.

Owns the engine around the decoding programs (rollouts/decoding.py): the weights it holds (in
their dtype, placement or quantized format), batches cut to the KV cache budget, groups by
max_new_tokens, images preprocessed, completions and scores returned through the
RolloutEngine protocol. It is the default engine on CPU and TPU and the one the tests use.
Batch size and prompt length are rounded up to buckets so that a run compiles a few shapes,
not one per call.
"""

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import host_allocator
from models import sharding
from models import projections, vision
from models.config import ModelConfig
from rollouts.decoding import (bucket, prompt_images, sample, score_continuations,
                               score_continuations_top_k)
from rollouts.engine import Capabilities, Completion, SamplingParams

# It keeps the arrays it is given, and a generate reads its weights once per call.
CAPABILITIES = Capabilities(pause=True, keeps_weight_arrays=True, release_memory=True)
# Holding its weights in another dtype or placement, it keeps copies of its own.
COPYING_CAPABILITIES = Capabilities(pause=True, release_memory=True)


def cache_bytes_per_token(cfg: ModelConfig) -> int:
  """Bytes of KV cache one token slot takes: keys and values of every layer."""
  return (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
          * jnp.dtype(cfg.compute_dtype).itemsize)


def _mesh_of(params):
  """The serving mesh of the devices `params` are placed on, when they are several, else
  None."""
  placed = getattr(jax.tree.leaves(params)[0], "sharding", None)
  mesh = getattr(placed, "mesh", None)
  if not isinstance(mesh, jax.sharding.Mesh) or mesh.size == 1:
    return None
  return sharding.serving_mesh(mesh)


def _check_replica_fits(params, placed, dtype) -> None:
  """ValueError when one device's share of the weights, held as `placed` in `dtype`, passes
  its free memory (checked where the device reports it: GPUs and TPUs)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return
  itemsize = lambda x: (dtype.itemsize if dtype is not None
                        and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize)
  need = sum(np.prod(where.shard_shape(x.shape)) * itemsize(x)
             for x, where in zip(jax.tree.leaves(params), jax.tree.leaves(placed)))
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if need > free:
    raise ValueError(
        f"JaxEngine: a replica of the weights takes {need / 2**30:.1f} GiB of each device, "
        f"{free / 2**30:.1f} GiB is free: set embedded_engine.layout = 'training' (weights "
        "read from the trainer's shards), a lower embedded_engine.dtype, or a mesh with a "
        "larger tensor axis")


def _cache_shards(cfg: ModelConfig, mesh) -> int:
  """Devices over which a batch's KV cache is split: its rows over data x fsdp, its KV heads
  over tensor where that divides them."""
  if mesh is None:
    return 1
  tensor = mesh.shape.get("tensor", 1)
  return (mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
          * (tensor if cfg.num_kv_heads % tensor == 0 else 1))


class JaxEngine:
  """RolloutEngine over `rollouts.decoding.sample`; weights are held in memory.

  `dtype` (e.g. 'bfloat16'): the weights are held (and read at every decode step) in this
  dtype, a copy made at each update, as an inference server holds them; None: the arrays
  given, as they are. `layout` of weights sharded over a mesh of several devices:
  'replicas' holds them split over its `tensor` axis only, whole on each data / fsdp replica,
  which decodes rows of its own (refused when a replica does not fit a device's free
  memory); 'training' reads them as the trainer places them (fsdp shards gathered at every
  decode step: slow, but no copy). `kv_cache_gib`: the most KV cache one device holds;
  prompts that need more are decoded in successive batches (None: all at once).
  `weight_format` ("fp8" or "int4", models/quantize.py): the decoder layers' projections are
  held in that format (quantized at each update: what a quantized checkpoint stores, and what
  a server on one receives at a refit), dequantized at each generate or score call."""

  def __init__(self, cfg: ModelConfig, params, *, version: int = 0, pad_id: int = 0,
               min_batch: int = 8, min_prompt_len: int = 16, dtype: str | None = None,
               kv_cache_gib: float | None = None, layout: str = "replicas",
               weight_format: str | None = None):
    if kv_cache_gib is not None and kv_cache_gib <= 0:
      raise ValueError(f"JaxEngine: kv_cache_gib must be > 0, got {kv_cache_gib}")
    if layout not in ("replicas", "training"):
      raise ValueError(f"JaxEngine: layout must be 'replicas' or 'training', got {layout!r}")
    # Held in a format, the weights are rounded already: the model must not round them again
    # (a quantization-aware trainer's cfg rounds its own).
    self._cfg = cfg if weight_format is None else dataclasses.replace(cfg, weight_format=None)
    self._dtype = None if dtype is None else jnp.dtype(dtype)
    self._mesh = _mesh_of(params) if layout == "replicas" else None
    if weight_format is not None and _mesh_of(params) is not None:
      raise ValueError("JaxEngine: weight_format holds the weights of one device; these are "
                       "placed on several (serve a quantized model from SGLang servers)")
    self._weight_format = weight_format
    if self._mesh is not None:  # checked once: updates take the same room
      _check_replica_fits(params, sharding.serving_shardings(params, self._mesh), self._dtype)
    self._cache_slots = (None if kv_cache_gib is None else
                         int(kv_cache_gib * 2**30) * _cache_shards(cfg, self._mesh)
                         // cache_bytes_per_token(cfg))
    self._hold = self._holder(params)
    # One attribute: a generate on another thread reads both at once.
    self._weights = (self._hold(params), version)
    self._pad_id = pad_id
    self._min_batch = min_batch
    self._min_prompt_len = min_prompt_len

  @property
  def version(self) -> int:
    return self._weights[1]

  @property
  def params(self):
    return self._weights[0]

  @property
  def capabilities(self) -> Capabilities:
    return CAPABILITIES if self._keeps_arrays() else COPYING_CAPABILITIES

  def update_weights(self, params, version: int, *, while_generating: bool = False) -> float:
    """A generate running meanwhile finishes on the weights it started with."""
    self._weights = (self._hold(params), version)
    return 0.0  # in memory: nothing to export or send

  def release_memory(self) -> float:
    """Drop the weights until the next update_weights (a hybrid deployment's switch to
    training): a copy of its own (in `dtype`, or on serving shardings) is freed, the
    trainer's own arrays only lose this reference. Its KV cache lives inside each generate
    call, so between calls there is none to free. Returns the seconds."""
    started = time.perf_counter()
    held, version = self._weights
    self._weights = (None, version)
    if held is not None and not self._keeps_arrays():
      for x in jax.tree.leaves(held):  # freed now, not whenever the runtime gets to it
        x.delete()
    host_allocator.return_freed_memory()  # on a CPU, the heap would keep it
    return time.perf_counter() - started

  def _released(self, what: str):
    """The weights, or RuntimeError after release_memory."""
    if self._weights[0] is None:
      raise RuntimeError(f"JaxEngine.{what}: the engine released its memory "
                         f"(release_memory); update_weights gives it weights again")
    return self._weights

  def _keeps_arrays(self) -> bool:
    return self._dtype is None and self._mesh is None and self._weight_format is None

  def _holder(self, params):
    """The function that makes `params` (and every update, of the same structure) what this
    engine reads: in its dtype, on its serving shardings, in its weight format. Compiled once,
    not per update."""
    if self._keeps_arrays():
      return lambda p: p
    cast = lambda x: (x.astype(self._dtype) if self._dtype is not None
                      and jnp.issubdtype(x.dtype, jnp.floating) else x)
    if self._weight_format is not None:
      return jax.jit(lambda p: projections.pack_projections(jax.tree.map(cast, p),
                                                            self._weight_format))
    placed = (None if self._mesh is None else
              sharding.serving_shardings(params, self._mesh))
    hold = jax.jit(lambda p: jax.tree.map(cast, p), out_shardings=placed)
    trained_on = getattr(getattr(jax.tree.leaves(params)[0], "sharding", None), "mesh", None)
    if placed is None or trained_on is self._mesh:
      return hold
    # A serving mesh that folds context or expert into data orders the devices otherwise than
    # the training mesh, and jit takes no inputs on another order: a transfer moves them.
    return lambda p: hold(jax.device_put(p, placed))

  @property
  def weight_bytes(self) -> int:
    """Bytes of the weights it holds (what a refit hands it, in its format and dtype)."""
    return sum(x.nbytes for x in jax.tree.leaves(self._released("weight_bytes")[0]))

  def close(self) -> None:
    pass

  def score(self, prompts: Sequence[Sequence[int]],
            continuations: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Teacher scoring: f32[len(continuation)] log-probs of each continuation's tokens."""
    with sharding.use(self._mesh):
      return score_continuations(self._released("score")[0], self._cfg, prompts, continuations,
                                 pad_id=self._pad_id, min_batch=self._min_batch,
                                 min_len=self._min_prompt_len)

  def score_top_k(self, prompts: Sequence[Sequence[int]],
                  continuations: Sequence[Sequence[int]], k: int
                  ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Teacher scoring with top-k distillation's teacher side (score_continuations_top_k):
    per continuation its tokens' log-probs f32[n], and i32[n, k] / f32[n, k] top-k."""
    with sharding.use(self._mesh):
      return score_continuations_top_k(self._released("score_top_k")[0], self._cfg, prompts,
                                       continuations, k, pad_id=self._pad_id,
                                       min_batch=self._min_batch, min_len=self._min_prompt_len)

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
               seed: int, affinity: Sequence[int] | None = None,
               max_new_tokens: Sequence[int] | None = None,
               on_ready: Callable[[dict[int, Completion]], None] | None = None,
               stop_when: Callable[[int, Completion], bool] | None = None,
               images: Sequence[Sequence[Any]] | None = None) -> list[Completion]:
    """Prompts with different `max_new_tokens` are decoded in groups of one power-of-two
    bucket each (so that a run compiles a few shapes), each cut to its own limit. `images`
    (a vision-language model's): each prompt's images (anything models.vision.open_image
    takes), in the order of its runs of image tokens."""
    del affinity  # one model in this process: nothing to route
    patched = self._preprocess(images, len(prompts))
    if stop_when is not None:
      raise ValueError("JaxEngine cannot abort requests (Capabilities.abort is False): it "
                       "decodes a batch to its end; stop_when needs servers")
    if not prompts:
      return []
    if any(len(p) == 0 for p in prompts):
      raise ValueError("JaxEngine.generate: every prompt needs at least one token")
    limits = ([sampling.max_new_tokens] * len(prompts) if max_new_tokens is None
              else [int(n) for n in max_new_tokens])
    if len(limits) != len(prompts) or min(limits) < 1 or max(limits) > sampling.max_new_tokens:
      raise ValueError(f"JaxEngine.generate: max_new_tokens must give each of the "
                       f"{len(prompts)} prompts a limit in [1, {sampling.max_new_tokens}], got "
                       f"{limits}")
    # One read of both: update_weights from another thread takes effect at the next call.
    params, version = self._released("generate")
    if len(set(limits)) == 1:  # one batch, decoded to exactly that limit
      groups = {limits[0]: list(range(len(prompts)))}
    else:
      groups = {}
      for row, limit in enumerate(limits):
        groups.setdefault(min(bucket(limit, 1), sampling.max_new_tokens), []).append(row)
    completions: list[Completion | None] = [None] * len(prompts)
    for max_new, rows in groups.items():
      key = jax.random.PRNGKey(seed)
      if len(groups) > 1:  # each group draws a stream of its own
        key = jax.random.fold_in(key, max_new)
      made = self._sample(params, version, [prompts[r] for r in rows], sampling, max_new, key,
                          None if patched is None else [patched[r] for r in rows])
      for row, completion in zip(rows, made):
        completions[row] = completion.cut(limits[row])
    if on_ready is not None:  # one batch: all are done together
      on_ready(dict(enumerate(completions)))
    return completions

  def _preprocess(self, images, count: int) -> list[list[vision.PatchedImage]] | None:
    """Each prompt's images preprocessed for the vision tower (None: no images)."""
    if images is None:
      return None
    if self._cfg.vision is None:
      raise ValueError(f"JaxEngine.generate: images given to a {self._cfg.family} model, "
                       "which has no vision tower")
    if len(images) != count:
      raise ValueError(f"JaxEngine.generate: images for {len(images)} prompts, {count} given")
    return vision.preprocess_each(images, self._cfg.vision)

  def _sample(self, params, version: int, prompts: Sequence[Sequence[int]],
              sampling: SamplingParams, max_new: int, key, images=None) -> list[Completion]:
    """`prompts` decoded in bucketed batches of up to `max_new` tokens each: one batch, or
    as many as the KV cache budget needs (each drawing a stream of its own)."""
    plen = bucket(max(len(p) for p in prompts), self._min_prompt_len)
    rows = self._rows_per_batch(plen + max_new)
    chunks = [prompts[start:start + rows] for start in range(0, len(prompts), rows)]
    completions = []
    for index, chunk in enumerate(chunks):
      chunk_key = key if len(chunks) == 1 else jax.random.fold_in(key, index)
      completions += self._sample_batch(
          params, version, chunk, plen, sampling, max_new, chunk_key,
          min(bucket(len(chunk), self._min_batch), rows),
          None if images is None else images[index * rows:(index + 1) * rows])
    return completions

  def _rows_per_batch(self, slots_per_row: int) -> int:
    """The most rows (a power of two) whose KV cache fits the budget; unbounded without one."""
    if self._cache_slots is None:
      return 1 << 62
    if self._cache_slots < slots_per_row:
      raise ValueError(
          f"JaxEngine: a KV cache of {self._cache_slots} token slots (kv_cache_gib) cannot "
          f"hold one sequence of {slots_per_row} (prompt bucket + max_new_tokens); raise "
          "kv_cache_gib or lower max_new_tokens")
    return 1 << ((self._cache_slots // slots_per_row).bit_length() - 1)

  def _sample_batch(self, params, version: int, prompts: Sequence[Sequence[int]], plen: int,
                    sampling: SamplingParams, max_new: int, key, batch: int, images=None
                    ) -> list[Completion]:
    """`prompts` decoded together in one batch of `batch` rows (left-padded to `plen`), with
    their preprocessed `images` (None: none)."""
    tokens = np.full((batch, plen), self._pad_id, np.int32)
    lens = np.ones((batch,), np.int32)
    for row, p in enumerate(prompts):
      tokens[row, plen - len(p):] = p
      lens[row] = len(p)
    with sharding.use(self._mesh):
      extra = (None if images is None else
               prompt_images(self._cfg.vision, prompts, images, batch, plen))
      out = sample(params, jnp.asarray(tokens), jnp.asarray(lens), key,
                   jnp.float32(sampling.temperature), jnp.float32(sampling.top_p), extra,
                   cfg=self._cfg, max_new=max_new, stop_ids=tuple(sampling.stop_token_ids))
      out_tokens, out_logp, lengths, stopped, experts = jax.device_get(out)
    completions = []
    for row, p in enumerate(prompts):
      k = int(lengths[row])
      completions.append(Completion(
          token_ids=out_tokens[row, :k].copy(), logprobs=out_logp[row, :k].copy(),
          finish_reason="stop" if stopped[row] else "length",
          versions=np.full((k,), version, np.int32),
          routed_experts=None if experts is None else
          experts[row, plen - len(p):plen + k - 1].copy()))
    return completions


def embedded_engine(cfg: ModelConfig, params, version: int, *, dtype: str | None = None,
                    kv_cache_gib: float | None = None, layout: str = "replicas",
                    weight_format: str | None = None) -> JaxEngine:
  """The engine factory of an in-process JaxEngine (a run's default): (cfg, params, version)
  -> an engine holding `params` as `version`, as rollouts.sglang_engine.local_engine and
  remote_engine are for servers. `dtype`, `kv_cache_gib` and `layout` are
  JaxEngine's (bindings: `train.engine = @embedded_engine`,
  `embedded_engine.dtype = 'bfloat16'`). `weight_format` ("fp8" or "int4"): the engine holds
  and computes on its weights in that format, as an engine serving a quantized checkpoint
  does (models/hf.py `save(..., quantization=...)`), while the trainer's model stays as
  configured (set the model's weight_format too for quantization-aware training: the trainer
  then computes on the same rounding)."""
  return JaxEngine(cfg, params, version=version, dtype=dtype, kv_cache_gib=kv_cache_gib,
                   layout=layout, weight_format=weight_format)


embedded_engine.capabilities = CAPABILITIES  # known before it makes one (rl.sources.check)
