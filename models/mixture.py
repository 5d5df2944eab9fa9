"""A mixture of experts' sparse block and everything about its routing: the router's scores
(Qwen3-MoE's softmax, DeepSeek-V3's sigmoid with a correction bias and groups) and the routed
tokens' weights, the experts run dropless (grouped matrix products), with a capacity, or
expert-parallel over a mesh's `expert` axis, the Route a layer reports (the experts chosen,
the native choice under replay, entropy, balance terms), the load-balancing loss, expert
counts and loss-free balancing's bias update, and routing metrics.

A mixture's sparse layers (ModelConfig.moe) route each token to its top k experts and run
them dropless: the (token, expert) pairs sorted by expert through grouped matrix products
(`dropless_experts`, jax.lax.ragged_dot); the experts' weights are stacked [E, in, out].
"""

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import lora
from models import sharding as shd
from models.config import ModelConfig, MoeConfig
from models.layers import swiglu
from models.projections import MLP


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
    # A LoRA kernel merged here, one layer's experts at a time (models/lora.py).
    expert = lambda name, shape: lora.weight(self.param(
        name, init, (moe.num_experts, *shape), cfg.param_dtype)).astype(cfg.compute_dtype)
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
