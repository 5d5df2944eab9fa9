"""Policy objectives: one function each, registered by name, composed into losses by `bind`.

Owns the per-token and per-trajectory objectives, the aggregation modes, the KL penalty every
loss can take, and the registry. A bound loss has the signature

    loss(logp, batch) -> (Weighted, metrics)

where `logp` f32[rows, seq] is the current policy's log-prob of each target and `batch` a
`TrainBatch`. `Weighted(total, count)` is divided once by the *global* count by the train
step, so a loss means the same under micro-batching, packing and data parallelism; metrics
are `Weighted` too.

A registered objective is `objective(logp, batch, *, hparams...) -> (values, metrics)` at one
of three levels:
  "token":    values f32[rows, seq], a loss per target (PPO's clipped surrogate); it may
              return a third element, the f32[rows, seq] mask it is averaged over (ReST
              counts only its successes);
  "sequence": values f32[rows * seq], one per trajectory as `sequence_sum` indexes them, each
              the trajectory's loss summed over its tokens (k1.5's squared sequence loss);
  "pair":     a `Weighted` over preference pairs (DPO), its own reduction.
`bind(name, hparams)` composes the objective with two pieces every rollout loss takes as
bindings, with defaults of the loss's registration:
  aggregation (one of AGGREGATIONS) and norm_length, the normaliser of
    `seq-mean-token-sum-norm`: how token or sequence values reduce to one Weighted;
  kl_coef and kl_estimator (rl.kl.ESTIMATORS): kl_coef * KL(pi || pi_ref) added per token
    (per trajectory: summed over its tokens), reading batch.ref_logp; 0 adds nothing.
`bind` refuses an unknown hyper-parameter or mode and a norm_length given to any other mode,
and traces the loss once on an abstract batch, so no binding it accepts fails inside jit.

Each objective declares the optional TrainBatch fields it reads (`reads`, a tuple or a
function of its hyper-parameters); with the KL penalty the bound loss also reads ref_logp.
The loop fills exactly the fields the bound loss (and the off-policy correction) read.

Adding a loss: write the objective, decorate it with `@register(name, advantage=..., level=...,
aggregation=...)`. A loss registered with `advantage=None` trains on something other than
rollouts (DPO: preference pairs, rl/long2short.py) and is refused by the RL loop.
"""

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from rl import ConfigError
from rl import advantages as advantages_lib
from rl import kl as kl_lib
from rl.types import OPTIONAL_FIELDS, TrainBatch


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
  Sequences with no masked token do not count. `norm_length` is Dr.GRPO's L_max, the maximum
  generation length; None uses the packed row length, a constant of the run (verl's default,
  the padded length). The other modes ignore it.
  """
  mask = batch.loss_mask
  masked = token_loss * mask
  if mode == "token-mean":
    return Weighted(jnp.sum(masked), jnp.sum(mask))
  return aggregate_sequences(sequence_sum(masked, batch), batch, mode, norm_length=norm_length)


def aggregate_sequences(sums, batch: TrainBatch, mode: str, *,
                        norm_length: float | None = None) -> Weighted:
  """Reduce per-trajectory sums over their tokens, f32[rows * seq] as `sequence_sum` gives
  them, in the same modes as `aggregate` (token-mean: sum_i s_i / sum_i |y_i|; the seq-mean
  modes: the mean over trajectories of s_i / |y_i|, s_i, s_i / norm_length); the entries of
  ids without a loss token must be 0. norm_length defaults to the packed row length."""
  tokens = sequence_sum(batch.loss_mask, batch)
  if mode == "token-mean":
    return Weighted(jnp.sum(sums), jnp.sum(tokens))
  num_seqs = jnp.sum(tokens > 0).astype(jnp.float32)
  if mode == "seq-mean-token-mean":
    return Weighted(jnp.sum(sums / jnp.maximum(tokens, 1.0)), num_seqs)
  if mode == "seq-mean-token-sum":
    return Weighted(jnp.sum(sums), num_seqs)
  if mode == "seq-mean-token-sum-norm":
    length = batch.loss_mask.shape[1] if norm_length is None else norm_length
    return Weighted(jnp.sum(sums) / length, num_seqs)
  raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def masked_mean(values, batch: TrainBatch) -> Weighted:
  return Weighted(jnp.sum(values * batch.loss_mask), jnp.sum(batch.loss_mask))


# ----------------------------------------------------------------------------- registry

LEVELS = ("token", "sequence", "pair")
# The hyper-parameters `bind` composes into every token and sequence loss.
COMPOSED = ("aggregation", "norm_length", "kl_coef", "kl_estimator")


@dataclasses.dataclass(frozen=True)
class LossDef:
  """A registered objective and what its losses are by default."""
  objective: Callable[..., tuple]
  advantage: str | None  # a key of rl.advantages.ESTIMATORS; None: not a rollout loss
  level: str
  aggregation: str = "token-mean"
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  reads: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = ()

  def fn(self, logp, batch: TrainBatch, **hparams):
    """The loss with `hparams` (unchecked: `bind` checks), on one batch."""
    return _compose(self, hparams)(logp, batch)

  @property
  def teacher(self) -> bool:
    """Whether its losses read a teacher's log-probs (the run needs teachers to score)."""
    return "teacher_logp" in _objective_reads(self, {})


LOSSES: dict[str, LossDef] = {}


def register(name: str, *, advantage: str | None, level: str = "token",
             aggregation: str = "token-mean", kl_coef: float = 0.0, kl_estimator: str = "k3",
             reads: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = ()):
  """Register an objective under `name` (see the module docstring)."""
  if advantage is not None and advantage not in advantages_lib.ESTIMATORS:
    raise ValueError(f"loss {name!r}: unknown advantage estimator {advantage!r}; valid: "
                     f"{sorted(advantages_lib.ESTIMATORS)}")
  if level not in LEVELS or aggregation not in AGGREGATIONS:
    raise ValueError(f"loss {name!r}: level {level!r} / aggregation {aggregation!r}; valid: "
                     f"{LEVELS} / {AGGREGATIONS}")
  unknown = [] if callable(reads) else sorted(set(reads) - set(OPTIONAL_FIELDS))
  if unknown:
    raise ValueError(f"loss {name!r} reads {unknown}, which are not TrainBatch fields; "
                     f"optional fields: {sorted(OPTIONAL_FIELDS)}")

  def add(fn):
    if name in LOSSES:
      raise ValueError(f"loss {name!r} is registered twice")
    LOSSES[name] = LossDef(fn, advantage, level, aggregation, kl_coef, kl_estimator, reads)
    return fn
  return add


def get(name: str) -> LossDef:
  if name not in LOSSES:
    raise ConfigError(f"unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))}")
  return LOSSES[name]


def rollout_losses() -> list[str]:
  """The names of the losses the RL loop can train with (those with an advantage), sorted."""
  return sorted(name for name, loss in LOSSES.items() if loss.advantage is not None)


def hyperparameters(name: str) -> dict[str, Any]:
  """The keyword hyper-parameters of loss `name` with their defaults: its objective's, and
  for a token or sequence loss the composed ones (COMPOSED)."""
  loss = get(name)
  params = inspect.signature(loss.objective).parameters.values()
  own = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
  if loss.level == "pair":
    return own
  return {**own, "aggregation": loss.aggregation, "norm_length": None,
          "kl_coef": loss.kl_coef, "kl_estimator": loss.kl_estimator}


def _objective_reads(loss: LossDef, hparams: dict[str, Any]) -> tuple[str, ...]:
  return tuple(loss.reads(hparams) if callable(loss.reads) else loss.reads)


def reads(name: str, hparams: dict[str, Any] | None = None) -> frozenset[str]:
  """The optional TrainBatch fields loss `name` with `hparams` reads."""
  loss = get(name)
  hparams = {**hyperparameters(name), **(hparams or {})}
  fields = set(_objective_reads(loss, hparams))
  if loss.level != "pair" and hparams["kl_coef"]:
    fields.add("ref_logp")
  return frozenset(fields)


def uses_reference(name: str, hparams: dict[str, Any] | None = None) -> bool:
  """Whether loss `name` with `hparams` needs reference log-probs (it reads ref_logp)."""
  return "ref_logp" in reads(name, hparams)


@dataclasses.dataclass(frozen=True)
class BoundLoss:
  """A loss with its hyper-parameters fixed: `(logp, batch) -> (Weighted, metrics)`, and the
  optional TrainBatch fields it reads."""
  name: str
  hparams: dict[str, Any]
  reads: frozenset[str]
  fn: Callable[[Any, TrainBatch], tuple[Weighted, dict[str, Weighted]]]

  def __call__(self, logp, batch: TrainBatch):
    return self.fn(logp, batch)


def bind(name: str, hparams: dict[str, Any] | None = None) -> BoundLoss:
  """The loss `name` with `hparams` fixed, checked against its signature (before any jit)."""
  loss = get(name)
  hparams = dict(hparams or {})
  defaults = hyperparameters(name)
  unknown = sorted(set(hparams) - set(defaults))
  if unknown:
    raise ConfigError(f"loss {name!r} has no hyper-parameter(s) {unknown}; it takes "
                      f"{sorted(defaults)}")
  _check_aggregation(name, {**defaults, **hparams})
  bound = BoundLoss(name, hparams, reads(name, hparams), _compose(loss, hparams))
  if loss.advantage is not None:
    _trace_once(bound)
  return bound


def _compose(loss: LossDef, hparams: dict[str, Any]) -> Callable:
  """The objective with the KL penalty and the aggregation of `hparams` (or its defaults)."""
  own = {k: v for k, v in hparams.items() if k not in COMPOSED}
  if loss.level == "pair":
    return lambda logp, batch: loss.objective(logp, batch, **own)
  mode = hparams.get("aggregation", loss.aggregation)
  norm_length = hparams.get("norm_length")
  kl_coef = hparams.get("kl_coef", loss.kl_coef)
  estimator = hparams.get("kl_estimator", loss.kl_estimator)

  def composed(logp, batch: TrainBatch):
    values, metrics, *mask = loss.objective(logp, batch, **own)
    reduced = batch.replace(loss_mask=mask[0]) if mask else batch
    if kl_coef:
      kl = kl_penalty(logp, batch, estimator)
      values = values + kl_coef * (kl if loss.level == "token" else sequence_sum(
          kl * reduced.loss_mask, batch))
      metrics = {**metrics, "kl": masked_mean(kl, batch)}
    if loss.level == "token":
      return aggregate(values, reduced, mode, norm_length=norm_length), metrics
    return aggregate_sequences(values, reduced, mode, norm_length=norm_length), metrics
  return composed


def kl_penalty(logp, batch: TrainBatch, estimator: str):
  """Per-token KL(pi || pi_ref) f32[rows, seq] from batch.ref_logp, by `estimator`."""
  if batch.ref_logp is None:
    raise ValueError("a loss with kl_coef > 0 needs reference log-probs (batch.ref_logp): give "
                     "the train step reference params, or set kl_coef=0")
  if estimator not in kl_lib.ESTIMATORS:
    raise ConfigError(f"unknown KL estimator {estimator!r}; valid: {sorted(kl_lib.ESTIMATORS)}")
  return kl_lib.ESTIMATORS[estimator](logp, batch.ref_logp)


def _trace_once(bound: BoundLoss):
  """Trace a rollout loss on an abstract f32[1, 8] batch holding the fields it reads (shapes
  only, nothing compiled), so that a value only the trace reads (a KL estimator, k2.5's
  window) or a field it reads but did not declare fails at binding, not after the SFT warm
  start."""
  shape = lambda meta: (1, 8, 2) if meta["top_k"] else (1, 8)
  values = jax.ShapeDtypeStruct((1, 8), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  optional = {name: jax.ShapeDtypeStruct(shape(meta), meta["dtype"])
              for name, meta in OPTIONAL_FIELDS.items() if name in bound.reads}
  if "teacher_topk_ids" in optional:  # the train step fills the student's side
    optional["student_topk_logp"] = jax.ShapeDtypeStruct((1, 8, 2), jnp.float32)
  batch = TrainBatch(tokens=ids, targets=ids, positions=ids, segment_ids=ids, loss_mask=values,
                     old_logp=values, advantages=values, **optional)
  jax.eval_shape(bound, values, batch)


def _check_aggregation(name: str, hparams: dict[str, Any]):
  """Refuse, before any trace, what `aggregate` would refuse or silently ignore."""
  if get(name).level == "pair":
    return
  mode = hparams["aggregation"]
  if mode not in AGGREGATIONS:
    raise ConfigError(f"loss {name!r}: unknown aggregation {mode!r}; valid: "
                      f"{', '.join(AGGREGATIONS)}")
  norm_length = hparams.get("norm_length")
  if norm_length is None:
    return
  if mode != "seq-mean-token-sum-norm":
    raise ConfigError(f"loss {name!r}: norm_length={norm_length!r} is the normaliser of "
                      f"aggregation 'seq-mean-token-sum-norm', but the aggregation is {mode!r}; "
                      "bind aggregation='seq-mean-token-sum-norm' as well, or drop norm_length")
  if isinstance(norm_length, bool) or not isinstance(norm_length, (int, float)) or (
      norm_length <= 0):
    raise ConfigError(f"loss {name!r}: norm_length={norm_length!r} must be a positive number "
                      "(L_max, the maximum generation length), or None for the packed row "
                      "length")


# ----------------------------------------------------------------------------- losses

def nll(logp, batch: TrainBatch) -> tuple[Weighted, dict[str, Weighted]]:
  """Negative log-likelihood of the masked targets, token-mean: the SFT objective."""
  return masked_mean(-logp, batch), {}


@register("k1.5", advantage="mean_baseline", level="sequence", aggregation="seq-mean-token-sum")
def kimi_k15(logp, batch: TrainBatch, *, tau: float = 0.01):
  """Kimi k1.5 online mirror descent surrogate (arXiv 2501.12599 sec. 2.3.2, eq. 3).

  Per trajectory j with advantage A_j = r_j - mean(r) (the group mean, j included, as in the
  paper) and sequence log-ratio D_j = sum_t m (logp - old_logp):

      l_j = (A_j - tau * D_j)**2 / (2 tau)

  whose gradient is -A_j grad D_j + tau D_j grad D_j, i.e. exactly minus eq. (3). The paper
  gives no tau; 0.01 is OpenKimi's `pmd_tau`. Averaged over trajectories (its default
  aggregation, seq-mean-token-sum: l_j is one trajectory's loss).
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
  return valid * per_seq, metrics


def _ratio(logp, batch: TrainBatch):
  """rho = pi / pi_old per token, the log-ratio clamped to [-20, 20] as in verl."""
  return jnp.exp(jnp.clip(logp - batch.old_logp, -20.0, 20.0))


def clipped_surrogate(ratio, batch: TrainBatch, *, eps_low: float, eps_high: float,
                      dual_clip: float | None = None):
  """PPO's per-token loss -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), with verl's
  optional dual clip (Ye et al. 2019) capping the loss at -dual_clip * A where A < 0.

  Returns (token_loss f32[rows, seq], metrics)."""
  adv = batch.advantages
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  token_loss = jnp.maximum(unclipped, clipped)
  metrics = {"clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), batch)}
  if dual_clip is not None:
    capped = jnp.minimum(token_loss, -adv * dual_clip)
    metrics["dual_clip_fraction"] = masked_mean(
        ((adv < 0) & (token_loss > capped)).astype(jnp.float32), batch)
    token_loss = jnp.where(adv < 0, capped, token_loss)
  return token_loss, metrics


@register("ppo", advantage="group_normalized")
def ppo(logp, batch: TrainBatch, *, eps_low: float = 0.2, eps_high: float = 0.2,
        dual_clip: float | None = None):
  """PPO clipped surrogate (arXiv 1707.06347) on outcome advantages, no value function:

      l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)

  eps = 0.2 (paper and verl); `dual_clip` (verl's clip_ratio_c, e.g. 3) caps the loss of
  negative-advantage tokens at -c A. token-mean aggregation as in verl.
  """
  return clipped_surrogate(_ratio(logp, batch), batch, eps_low=eps_low, eps_high=eps_high,
                           dual_clip=dual_clip)


@register("grpo", advantage="group_normalized", aggregation="seq-mean-token-mean",
          kl_coef=0.04, kl_estimator="k3")
def grpo(logp, batch: TrainBatch, *, clip_eps: float = 0.2):
  """GRPO (DeepSeekMath, arXiv 2402.03300): PPO-clip on group-normalised advantages plus
  kl_coef * KL(pi || pi_ref) per token in the loss, seq-mean-token-mean aggregation.

      l_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) + kl_coef * k3(logp, ref_logp)


  beta = 0.04 and the k3 estimator are the paper's; the paper states no eps, 0.2 is the
  convention (PPO, TRL, verl). The KL term is the composed one (its registration's
  defaults: kl_coef 0.04, k3); with kl_coef > 0 the train step needs reference params.
  """
  return clipped_surrogate(_ratio(logp, batch), batch, eps_low=clip_eps, eps_high=clip_eps)


@register("dr_grpo", advantage="mean_baseline", aggregation="seq-mean-token-sum-norm")
def dr_grpo(logp, batch: TrainBatch, *, clip_eps: float = 0.2):
  """Dr. GRPO (arXiv 2503.20783): GRPO without the std in the advantage (A = r - mean) and
  without length normalisation: the loss is sum_{i,t} m l / (B * L_max), as in the paper's
  code (oat) and TRL; verl's `seq-mean-token-sum-norm` leaves out the 1/B.

  `norm_length` is L_max, the maximum generation length; None uses the packed row length, a
  constant of the run (verl's default, the padded length). No KL term.
  """
  return clipped_surrogate(_ratio(logp, batch), batch, eps_low=clip_eps, eps_high=clip_eps)


@register("dapo", advantage="group_normalized")
def dapo(logp, batch: TrainBatch, *, eps_low: float = 0.2, eps_high: float = 0.28):
  """DAPO (arXiv 2503.14476): clip-higher (eps_low 0.2, eps_high 0.28) and one token-level
  normaliser over the whole batch; no KL. Its dynamic sampling and overlong shaping are a
  sampling and a reward transform (rl/sampling.py, rl/rewards.py)."""
  return clipped_surrogate(_ratio(logp, batch), batch, eps_low=eps_low, eps_high=eps_high)


@register("gspo", advantage="group_normalized", aggregation="seq-mean-token-mean")
def gspo(logp, batch: TrainBatch, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
  """GSPO (arXiv 2507.18071): a sequence-level ratio s_i = exp(mean_t (logp - old_logp)),
  clipped as in PPO, in its GSPO-token form (same value, gradient through each token):

      log s_it = logp_t - sg(logp_t) + sg(log s_i),   capped at 10 as in verl
      l_it = -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)

  eps 3e-4 / 4e-4 as in the paper and verl; seq-mean-token-mean by default (verl forces it).
  """
  mask = batch.loss_mask
  tokens = sequence_sum(mask, batch)
  mean_log_ratio = sequence_sum((logp - batch.old_logp) * mask, batch) / jnp.maximum(tokens, 1)
  index, _ = _sequence_index(batch)
  seq_log_ratio = mean_log_ratio[index].reshape(logp.shape)
  log_s = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)
  ratio = jnp.exp(jnp.minimum(log_s, 10.0))
  token_loss, metrics = clipped_surrogate(ratio, batch, eps_low=eps_low, eps_high=eps_high)
  metrics["sequence_ratio"] = masked_mean(ratio, batch)
  return token_loss, metrics


@register("cispo", advantage="group_normalized")
def cispo(logp, batch: TrainBatch, *, eps_low: float | None = None, eps_high: float = 0.2):
  """CISPO (MiniMax-M1, arXiv 2506.13585 sec. 3.1): REINFORCE weighted by a clipped,
  stop-gradient importance ratio, so every token keeps a gradient:

      l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) * A * logp_t

  The paper uses no lower bound (eps_low=None) and gives no eps_high; 0.2 is verl's example.
  TRL's `epsilon_high` is an absolute cap instead (5.0 there is eps_high=4.0 here).
  """
  ratio = _ratio(logp, batch)
  lower = 0.0 if eps_low is None else 1.0 - eps_low
  weight = jax.lax.stop_gradient(jnp.clip(ratio, lower, 1.0 + eps_high))
  token_loss = -weight * batch.advantages * logp
  metrics = {"clip_fraction": masked_mean(
      ((ratio > 1.0 + eps_high) | (ratio < lower)).astype(jnp.float32), batch)}
  return token_loss, metrics


@register("rloo", advantage="leave_one_out", aggregation="seq-mean-token-sum")
def rloo(logp, batch: TrainBatch):
  """REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740):
  l_i = -(r_i - mean_{j != i} r_j) * sum_t logp_t, averaged over sequences. No ratio: exact
  on-policy; with several minibatches per step the later ones are slightly off-policy."""
  return -batch.advantages * logp, {}


@register("rest", advantage="success_indicator")
def rest(logp, batch: TrainBatch):
  """ReST / RFT, positive-only (k1.5 sec. 3 "negative gradients"): the negative log-likelihood
  of the successful completions only (A = 1[r >= 1]); failed ones carry no gradient and do
  not count in the normaliser (the mask it returns)."""
  return -logp, {}, batch.loss_mask * (batch.advantages > 0)


@register("k2.5", advantage="mean_baseline")
def kimi_k25(logp, batch: TrainBatch, *, alpha: float = -1.0, beta: float = 1.0,
             tau: float = 0.01, window: str = "log_ratio"):
  """Kimi K2.5 token-level masking (arXiv 2602.02276 sec. 4.4.2, the reading recommended in
  objectives.md): maximise the token mean over the batch of

      M_t * rho_t * (r - mean r) - tau * (log rho_t)**2,   M_t = 1[alpha <= log rho_t <= beta]

  so the policy gradient is exactly zero outside the window whatever the advantage's sign;
  the squared penalty is not masked. `window="ratio"` reads [alpha, beta] as ratio bounds
  instead (then 0 < alpha < 1 < beta). The report gives no alpha, beta or tau: the defaults
  here (log-ratio window [-1, 1], tau 0.01 as k1.5) are ours.
  """
  if window not in ("log_ratio", "ratio"):
    raise ConfigError(f"k2.5 window must be 'log_ratio' or 'ratio', got {window!r}")
  log_ratio = jnp.clip(logp - batch.old_logp, -20.0, 20.0)
  measure = log_ratio if window == "log_ratio" else jnp.exp(log_ratio)
  inside = (measure >= alpha) & (measure <= beta)
  policy_term = jnp.where(inside, jnp.exp(log_ratio) * batch.advantages, 0.0)
  token_loss = -policy_term + tau * jnp.square(log_ratio)
  metrics = {"clip_fraction": masked_mean((~inside).astype(jnp.float32), batch)}
  return token_loss, metrics


def _opd_reads(hparams: dict[str, Any]) -> tuple[str, ...]:
  topk = ("teacher_topk_ids", "teacher_topk_logp") if hparams.get("topk_coef") else ()
  return ("teacher_logp",) + topk


@register("opd", advantage="group_normalized", reads=_opd_reads)
def on_policy_distillation(logp, batch: TrainBatch, *, advantage_clip: float = 5.0,
                           reward_weight: float = 0.0, eps_low: float = 0.2,
                           eps_high: float = 0.2, topk_coef: float = 0.0):
  """On-policy distillation (MOPD, arXiv 2606.30406; Kimi K3's merge of its experts): the
  student samples, a teacher scores the same tokens, and the clipped teacher-minus-student
  log-prob is a dense per-token advantage,

      A_t = clip(teacher_logp_t - old_logp_t, -advantage_clip, advantage_clip)
            + reward_weight * A_outcome,

  in PPO's clipped surrogate. Its expected gradient at A_outcome = 0 is that of the reverse
  KL(student || teacher) on the student's own samples. old_logp is the student's sampling
  log-prob (the engine's); A_outcome is the task reward's group-normalised advantage, mixed
  in when reward_weight > 0. The clip of 5 nats is ours.

  topk_coef > 0 adds topk_coef * KL(teacher || student) over the teacher's top-k next tokens
  at each position (both renormalised over those k; the teachers must give them:
  Teachers(top_k=k)). K3 reports no gain from it over the sampled-token form alone.
  """
  if batch.teacher_logp is None:
    raise ValueError("loss 'opd' needs teacher log-probs (batch.teacher_logp): give the run "
                     "teachers to score the student's trajectories")
  gap = batch.teacher_logp - batch.old_logp
  dense = jnp.clip(gap, -advantage_clip, advantage_clip) + reward_weight * batch.advantages
  token_loss, metrics = clipped_surrogate(_ratio(logp, batch), batch.replace(advantages=dense),
                                          eps_low=eps_low, eps_high=eps_high)
  metrics["teacher_minus_student"] = masked_mean(gap, batch)
  metrics["advantage_clip_fraction"] = masked_mean(
      (jnp.abs(gap) > advantage_clip).astype(jnp.float32), batch)
  if topk_coef:
    if batch.teacher_topk_logp is None or batch.student_topk_logp is None:
      raise ValueError("loss 'opd' with topk_coef > 0 needs the teachers' top-k tokens: give "
                       "rl.distill.Teachers top_k > 0")
    teacher = jax.nn.log_softmax(batch.teacher_topk_logp, axis=-1)
    student = jax.nn.log_softmax(batch.student_topk_logp, axis=-1)
    topk_kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
    token_loss = token_loss + topk_coef * topk_kl
    metrics["topk_kl"] = masked_mean(topk_kl, batch)
  return token_loss, metrics


@register("dpo", advantage=None, level="pair", reads=("ref_logp",))
def dpo(logp, batch: TrainBatch, *, beta: float = 0.1):
  """DPO (Rafailov et al. 2023, arXiv 2305.18290), k1.5's long2short preference step, on
  pairs laid out by rl.packing.pair_batch (segment 2k+1 of a row is the chosen completion,
  2k+2 the rejected one for the same prompt). With D(y) = sum_t m (logp - ref_logp):

      l = -log sigmoid(beta * (D(y_chosen) - D(y_rejected)))

  averaged over pairs; the reference is the frozen policy DPO starts from (ref_logp, filled
  by the train step from its ref_params). beta 0.1 as in the paper's experiments and TRL.
  """
  if batch.ref_logp is None:
    raise ValueError("loss 'dpo' needs reference log-probs: give the train step ref_params "
                     "(the frozen policy before DPO)")
  rows, seq = batch.tokens.shape
  mask = batch.loss_mask
  reward = sequence_sum((logp - batch.ref_logp) * mask, batch).reshape(rows, seq)
  tokens = sequence_sum(mask, batch).reshape(rows, seq)
  pairs = (seq - 1) // 2  # segment ids run 1..seq-1 at most
  chosen, rejected = reward[:, 1:2 * pairs:2], reward[:, 2:2 * pairs + 1:2]
  valid = ((tokens[:, 1:2 * pairs:2] > 0) & (tokens[:, 2:2 * pairs + 1:2] > 0)
           ).astype(jnp.float32)
  margin = beta * (chosen - rejected)
  num_pairs = jnp.sum(valid)
  per_pair = lambda x: Weighted(jnp.sum(valid * x), num_pairs)
  metrics = {"reward_accuracy": per_pair((margin > 0).astype(jnp.float32)),
             "reward_margin": per_pair(margin),
             "chosen_reward": per_pair(beta * chosen),
             "rejected_reward": per_pair(beta * rejected)}
  return per_pair(-jax.nn.log_sigmoid(margin)), metrics
