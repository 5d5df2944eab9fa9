"""The jitted update: log-probs -> loss -> gradients (summed over micro-batches) -> optax.

Owns `TrainState` and `make_train_step`. The loss is any function
`(logp, TrainBatch) -> (Weighted, metrics)` (rl/losses.py); totals and counts are summed over
micro-batches and divided once, so the update does not depend on how the batch is split.
"""

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from models import logprobs as logprobs_lib
from models import lora, mixture, transformer
from models.config import ModelConfig
from rl import kl as kl_lib
from rl.types import TrainBatch


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: jax.Array  # i32[] optimizer updates so far


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def replayed_routes(batch: TrainBatch, replay: bool):
  """The experts the forward pass routes batch's tokens to: the engine's (routing replay), or
  None (the router's own)."""
  if not replay:
    return None
  if batch.routed_experts is None:
    raise ValueError("routing replay needs the experts the engine routed each token to "
                     "(TrainBatch.routed_experts), and the engine reported none: a mixture "
                     "of experts on an engine that records its routing (SGLang: "
                     "--enable-return-routed-experts)")
  return batch.routed_experts


def policy_logprobs(params, cfg: ModelConfig, batch: TrainBatch, *, chunk_size: int = 2048,
                    replay: bool = False):
  """(logp, entropy) f32[rows, seq] of batch.targets under `params`; with `replay`, a
  mixture's tokens routed to batch.routed_experts."""
  hidden, _ = transformer.forward_with_routes(params, cfg, batch.tokens, batch.positions,
                                              batch.segment_ids,
                                              replayed_routes(batch, replay),
                                              images=batch.images)
  return logprobs_lib.token_logprobs(hidden, transformer.output_projection(params, cfg),
                                     batch.targets, chunk_size=chunk_size)


def micro_step(params, ref_params, mb: TrainBatch, *, cfg: ModelConfig, loss_fn: Callable,
               logprob_chunk: int, replay: bool = False, balance_coef: float = 0.0,
               base=None):
  """One micro-batch's gradient of the loss's total, its (total, count) sums (loss, entropy,
  logp_diff_mean, ratio_mean, kl_to_old, kl_to_reference, the loss's own metrics,
  clip_fraction, a mixture's routing metrics) and max |logp - old_logp| over loss tokens.
  With `ref_params`, mb.ref_logp is computed under them first (routed by the reference's own
  router); with `replay`, the policy's tokens go to mb.routed_experts; with `balance_coef`,
  a mixture's load-balancing loss over the real tokens is added, times the loss's count (so
  that the step's division by the counts leaves balance_coef times it). With `base` (a LoRA
  run's frozen base), `params` are its adapters (models/lora.py), and the gradient theirs."""
  if ref_params is not None:
    ref_logp, _ = policy_logprobs(ref_params, cfg, mb, chunk_size=logprob_chunk)
    mb = mb.replace(ref_logp=jax.lax.stop_gradient(ref_logp))
  replay_to = replayed_routes(mb, replay)

  def objective(p):
    p = p if base is None else lora.attach(base, p)
    hidden, routes = transformer.forward_with_routes(p, cfg, mb.tokens, mb.positions,
                                                     mb.segment_ids, replay_to,
                                                     images=mb.images)
    unembed = transformer.output_projection(p, cfg)
    logp, entropy = logprobs_lib.token_logprobs(hidden, unembed, mb.targets,
                                                chunk_size=logprob_chunk)
    batch = mb
    if mb.teacher_topk_ids is not None:  # top-k distillation: the student on those tokens
      batch = mb.replace(student_topk_logp=logprobs_lib.logprobs_of(
          hidden, unembed, mb.teacher_topk_ids, chunk_size=logprob_chunk))
    weighted, metrics = loss_fn(logp, batch)
    total = weighted.total
    if balance_coef:
      total += balance_coef * jax.lax.stop_gradient(weighted.count) * mixture.balance_loss(
          routes, mb.segment_ids > 0)
    return total, (weighted, metrics, logp, entropy, routes)

  grads, (weighted, metrics, logp, entropy, routes) = jax.grad(objective, has_aux=True)(params)
  mask = mb.loss_mask
  diff = jnp.abs(logp - mb.old_logp) * mask
  tokens = jnp.sum(mask)
  masked_sum = lambda x: (jnp.sum(x * mask), tokens)
  sums = {"loss": (weighted.total, weighted.count),
          "entropy": masked_sum(entropy),
          "logp_diff_mean": (jnp.sum(diff), tokens),
          "ratio_mean": masked_sum(jnp.exp(jnp.clip(logp - mb.old_logp, -20.0, 20.0))),
          "kl_to_old": masked_sum(kl_lib.k3(logp, mb.old_logp))}
  if mb.ref_logp is not None:
    sums["kl_to_reference"] = masked_sum(kl_lib.k3(logp, mb.ref_logp))
  sums.update({k: (w.total, w.count) for k, w in metrics.items()})
  sums.setdefault("clip_fraction", (jnp.zeros(()), tokens))  # losses that never clip
  if routes is not None:  # a mixture's routing over the micro-batch's real tokens
    real = mb.segment_ids > 0
    weight = jnp.sum(real).astype(jnp.float32)
    routing = mixture.routing_metrics(routes, real, cfg.moe.num_experts,
                                          mb.routed_experts)
    sums.update({k: (v * weight, weight) for k, v in routing.items()})
    if cfg.moe.correction_bias:  # for loss-free balancing (make_train_step)
      sums["expert_counts"] = (mixture.expert_counts(routes, real, cfg.moe.num_experts),
                               weight)
  return grads, sums, jnp.max(diff)


def _check_balancing(cfg: ModelConfig, expert_bias_rate: float, balance_coef: float) -> None:
  """ValueError for balancing options the model has nothing to balance for."""
  if expert_bias_rate and (cfg.moe is None or not cfg.moe.correction_bias):
    raise ValueError(f"expert_bias_rate={expert_bias_rate} moves a mixture's correction bias "
                     "(MoeConfig.correction_bias); the model has none")
  if balance_coef and cfg.moe is None:
    raise ValueError(f"balance_coef={balance_coef} weighs a mixture's load-balancing loss; "
                     "the model is dense")


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation,
                    loss_fn: Callable, *, micro_batches: int = 1, logprob_chunk: int = 2048,
                    state_shardings=None, donate_state: bool = False, replay: bool = False,
                    expert_bias_rate: float = 0.0, balance_coef: float = 0.0, arms: bool = False):
  """A jitted `step(state, batch, ref_params=None, base=None) -> (state, metrics)`.

  batch: TrainBatch with rows divisible by `micro_batches`. With `ref_params`, the batch's
  ref_logp is computed under them (for losses with a KL to a reference policy). With `base`,
  a LoRA run's frozen base (never donated): state.params are its adapters, the policy
  lora.attach(base, state.params) (models/lora.py), and only the adapters move.
  replay: rollout routing replay: a mixture's tokens go to the experts the engine chose
  (batch.routed_experts), their gate weights the trainer's router's at those experts.
  expert_bias_rate: after the update, a mixture's correction biases move by it against the
  step's load (mixture.balance_experts: DeepSeek-V3's loss-free balancing, 0.001 there).
  balance_coef: a mixture's load-balancing loss (mixture.balance_loss) times it is added
  to the loss (Qwen3-MoE's router_aux_loss_coef, 0.001 there).
  metrics: f32 scalars over loss tokens: loss, entropy, the loss's own metrics (clip_fraction
  is 0 for losses that do not clip), grad_norm, for a mixture of experts its routing over the
  real tokens (mixture.routing_metrics: expert_load_cv, expert_load_max, router_entropy,
  and when the batch carries the engine's routes routing_differs / router_differs, the
  share of tokens the trainer routed / its router would route otherwise than the engine:
  the first 0 with replay; expert_balance_loss), ratio_mean (pi / pi_old), kl_to_old and
  kl_to_reference (k3), and logp_diff_mean / logp_diff_max, |trainer - batch.old_logp|: on
  the first update of a rollout batch, the engine-vs-trainer mismatch.
  state_shardings (models.sharding.state_shardings): keeps the updated state sharded like
  its input; call the step inside the mesh (models.sharding.on_mesh).
  arms: the step of K stacked arms (over_arms).
  donate_state: the updated state takes the input state's buffers (an update in place, as
  PyTorch's optimizers do) and the input state is deleted: one copy of the parameters and
  optimizer moments less at the step's peak, and no fresh buffers for the host allocator to
  fit around the old ones every step (bench/peers.py: peak RSS flat at 1.71 GiB over six
  rematerialised steps where it grew from 1.97 to 2.94 GiB). Only for a caller that reads no
  other reference to the state's arrays after the step (the engine's weights before
  update_weights, a reference policy sharing them); an orbax save still reading them is safe,
  as JAX then copies instead of donating.
  """

  _check_balancing(cfg, expert_bias_rate, balance_coef)

  def step(state: TrainState, batch: TrainBatch, ref_params=None, base=None):
    rows = batch.tokens.shape[0]
    if rows % micro_batches:
      raise ValueError(f"train step: {rows} rows do not split into {micro_batches} micro-batches")
    split = jax.tree.map(lambda x: x.reshape(micro_batches, rows // micro_batches, *x.shape[1:]),
                         batch)

    def accumulate(carry, mb):
      grads, sums, diff_max = micro_step(state.params, ref_params, mb, cfg=cfg, loss_fn=loss_fn,
                                         logprob_chunk=logprob_chunk, replay=replay,
                                         balance_coef=balance_coef, base=base)
      if carry is None:
        return grads, sums, diff_max
      add = lambda a, b: jax.tree.map(jnp.add, a, b)
      return add(carry[0], grads), add(carry[1], sums), jnp.maximum(carry[2], diff_max)

    first = jax.tree.map(lambda x: x[0], split)
    carry = accumulate(None, first)
    if micro_batches > 1:
      rest = jax.tree.map(lambda x: x[1:], split)
      carry, _ = jax.lax.scan(lambda c, mb: (accumulate(c, mb), None), carry, rest)
    grads, sums, diff_max = carry
    counts = sums.pop("expert_counts", (None,))[0]
    count = jnp.maximum(sums["loss"][1], 1.0)
    # In the params' dtype: a float32 count would promote bf16 gradients, and with them
    # AdamW's first moment (optax keeps it in the gradients' dtype), to float32.
    grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if expert_bias_rate and counts is not None:
      params = mixture.balance_experts(params, cfg, counts, expert_bias_rate)
    metrics = {k: total / jnp.maximum(n, 1.0) for k, (total, n) in sums.items()}
    metrics["logp_diff_max"] = diff_max
    metrics["grad_norm"] = optax.tree.norm(grads)
    new_state = TrainState(params, opt_state, state.step + 1)
    if state_shardings is not None:  # keep params and moments where they were placed
      new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
    return new_state, metrics

  return jax.jit(over_arms(step) if arms else step, donate_argnums=0 if donate_state else ())


def over_arms(step: Callable) -> Callable:
  """`step(state, batch, ref_params=None, base=None)` of K arms in one program (rl/arms.py):
  every leaf of the state and the batch has a leading arm axis [K, ...], the base and
  ref_params are shared, and each metric is f32[K], each arm's as its step alone gives it."""
  # Positionally: vmap maps keyword arguments over their leading axis, and the base is shared.
  return lambda state, batch, ref_params=None, base=None: jax.vmap(
      step, in_axes=(0, 0, None, None))(state, batch, ref_params, base)
