"""Policy objectives: one function each, registered by name.

Owns the per-token objectives, the aggregation modes and the registry. Every loss has the
signature

    loss(logp, batch, *, hparams...) -> (Weighted, metrics)

where `logp` f32[rows, seq] is the current policy's log-prob of each target and `batch` a
`TrainBatch`. `Weighted(total, count)` is divided once by the *global* count by the train
step, so a loss means the same under micro-batching, packing and data parallelism; metrics
are `Weighted` too. Each loss is registered with the advantage estimator it is defined with
(rl/advantages.py).

A loss with a KL term to a reference policy names its weight `kl_coef`; whenever that is
non-zero the loop keeps the SFT model as the reference and fills `batch.ref_logp`.

Adding a loss: write the function, decorate it with `@register(name, advantage=...)`.
"""

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from rl import ConfigError
from rl import advantages as advantages_lib
from rl import kl as kl_lib
from rl.types import TrainBatch


class Weighted(NamedTuple):
  """A sum and the count it is to be divided by (after summing over micro-batches)."""
  total: jax.Array
  count: jax.Array


# ----------------------------------------------------------------------------- aggregation

def _sequence_index(batch: TrainBatch):
  """A global id per (row, segment) for segment sums: i32[rows * seq]."""
  rows, seq = batch.segment_ids.shape
  return (jnp.arange(rows)[:, None] * seq + batch.segment_ids).reshape(-1), rows * seq


def sequence_sum(values, batch: TrainBatch):
  """Sum of f32[rows, seq] over each trajectory (padding and segment 0 included; mask the
  values first) -> f32[rows * seq], indexed by (row, segment)."""
  index, n = _sequence_index(batch)
  return jax.ops.segment_sum(values.reshape(-1), index, n)


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


def aggregate(token_loss, batch: TrainBatch, mode: str, *, norm_length: float | None = None
              ) -> Weighted:
  """Reduce a per-token loss f32[rows, seq] over `batch.loss_mask` (verl `agg_loss` names).

  token-mean:              sum_{i,t} m l / sum m                      (DAPO, CISPO)
  seq-mean-token-mean:     mean_i [ sum_t m l / |y_i| ]                (GRPO)
  seq-mean-token-sum:      mean_i [ sum_t m l ]
  seq-mean-token-sum-norm: mean_i [ sum_t m l ] / norm_length          (Dr.GRPO; as in the
                           paper's code and TRL, i.e. with the 1/B that verl leaves out)
  Sequences with no masked token do not count.
  """
  mask = batch.loss_mask
  masked = token_loss * mask
  if mode == "token-mean":
    return Weighted(jnp.sum(masked), jnp.sum(mask))
  tokens = sequence_sum(mask, batch)
  sums = sequence_sum(masked, batch)
  num_seqs = jnp.sum(tokens > 0).astype(jnp.float32)
  if mode == "seq-mean-token-mean":
    return Weighted(jnp.sum(sums / jnp.maximum(tokens, 1.0)), num_seqs)
  if mode == "seq-mean-token-sum":
    return Weighted(jnp.sum(sums), num_seqs)
  if mode == "seq-mean-token-sum-norm":
    if norm_length is None:
      raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_length (Dr.GRPO's "
                       "L_max, the maximum generation length)")
    return Weighted(jnp.sum(sums) / norm_length, num_seqs)
  raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def masked_mean(values, batch: TrainBatch) -> Weighted:
  return Weighted(jnp.sum(values * batch.loss_mask), jnp.sum(batch.loss_mask))


# ----------------------------------------------------------------------------- registry

@dataclasses.dataclass(frozen=True)
class LossDef:
  fn: Callable[..., tuple[Weighted, dict[str, Weighted]]]
  advantage: str  # a key of rl.advantages.ESTIMATORS


LOSSES: dict[str, LossDef] = {}


def register(name: str, *, advantage: str):
  if advantage not in advantages_lib.ESTIMATORS:
    raise ValueError(f"loss {name!r}: unknown advantage estimator {advantage!r}; valid: "
                     f"{sorted(advantages_lib.ESTIMATORS)}")

  def add(fn):
    if name in LOSSES:
      raise ValueError(f"loss {name!r} is registered twice")
    LOSSES[name] = LossDef(fn, advantage)
    return fn
  return add


def get(name: str) -> LossDef:
  if name not in LOSSES:
    raise ConfigError(f"unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))}")
  return LOSSES[name]


def hyperparameters(name: str) -> dict[str, Any]:
  """The keyword hyper-parameters of loss `name` with their defaults."""
  params = inspect.signature(get(name).fn).parameters.values()
  return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def uses_reference(name: str, hparams: dict[str, Any] | None = None) -> bool:
  """Whether loss `name` with `hparams` needs reference log-probs (a non-zero `kl_coef`)."""
  return bool({**hyperparameters(name), **(hparams or {})}.get("kl_coef", 0.0))


def bind(name: str, hparams: dict[str, Any] | None = None):
  """The loss `name` with `hparams` fixed, checked against its signature (before any jit)."""
  loss = get(name)
  hparams = dict(hparams or {})
  unknown = sorted(set(hparams) - set(hyperparameters(name)))
  if unknown:
    raise ConfigError(f"loss {name!r} has no hyper-parameter(s) {unknown}; it takes "
                    f"{sorted(hyperparameters(name))}")
  return lambda logp, batch: loss.fn(logp, batch, **hparams)


# ----------------------------------------------------------------------------- losses

def nll(logp, batch: TrainBatch) -> tuple[Weighted, dict[str, Weighted]]:
  """Negative log-likelihood of the masked targets, token-mean: the SFT objective."""
  return masked_mean(-logp, batch), {}


@register("k1.5", advantage="mean_baseline")
def kimi_k15(logp, batch: TrainBatch, *, tau: float = 0.01):
  """Kimi k1.5 online mirror descent surrogate (arXiv 2501.12599 sec. 2.3.2, eq. 3).

  Per trajectory j with advantage A_j = r_j - mean(r) (the group mean, j included, as in the
  paper) and sequence log-ratio D_j = sum_t m (logp - old_logp):

      l_j = (A_j - tau * D_j)**2 / (2 tau)

  whose gradient is -A_j grad D_j + tau D_j grad D_j, i.e. exactly minus eq. (3). The paper
  gives no tau; 0.01 is OpenKimi's `pmd_tau`. Averaged over trajectories.
  """
  mask = batch.loss_mask
  log_ratio = (logp - batch.old_logp) * mask
  tokens = sequence_sum(mask, batch)
  delta = sequence_sum(log_ratio, batch)
  adv = sequence_sum(batch.advantages * mask, batch) / jnp.maximum(tokens, 1.0)
  valid = (tokens > 0).astype(jnp.float32)
  per_seq = jnp.square(adv - tau * delta) / (2.0 * tau)
  num_seqs = jnp.sum(valid)
  metrics = {
      "log_ratio_seq": Weighted(jnp.sum(valid * delta), num_seqs),
      "log_ratio_abs_seq": Weighted(jnp.sum(valid * jnp.abs(delta)), num_seqs),
  }
  return Weighted(jnp.sum(valid * per_seq), num_seqs), metrics


@register("grpo", advantage="group_normalized")
def grpo(logp, batch: TrainBatch, *, clip_eps: float = 0.2, kl_coef: float = 0.04,
         kl_estimator: str = "k3", aggregation: str = "seq-mean-token-mean"):
  """GRPO (DeepSeekMath, arXiv 2402.03300): PPO-clip on group-normalised advantages plus
  kl_coef * KL(pi || pi_ref) per token in the loss, seq-mean-token-mean aggregation.

      l_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) + kl_coef * k3(logp, ref_logp)

  beta = 0.04 and the k3 estimator are the paper's; the paper states no eps, 0.2 is the
  convention (PPO, TRL, verl). With kl_coef > 0 the train step needs reference params.
  """
  ratio = jnp.exp(jnp.clip(logp - batch.old_logp, -20.0, 20.0))
  adv = batch.advantages
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  token_loss = jnp.maximum(unclipped, clipped)
  metrics = {"clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), batch),
             "ratio": masked_mean(ratio, batch)}
  if kl_coef:
    if batch.ref_logp is None:
      raise ValueError("loss 'grpo' with kl_coef > 0 needs reference log-probs: give the train "
                       "step reference params, or set kl_coef=0")
    kl = kl_lib.ESTIMATORS[kl_estimator](logp, batch.ref_logp)
    token_loss = token_loss + kl_coef * kl
    metrics["kl"] = masked_mean(kl, batch)
  return aggregate(token_loss, batch, aggregation), metrics
