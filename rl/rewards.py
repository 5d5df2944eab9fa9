"""Reward transforms: optax-style `(init, update)` pairs over `Rollouts`.

Owns how verifier verdicts become scalar rewards, and the combinators. A transform's
`update(rollouts, state, *, step) -> (rollouts, state)` may change `reward` and `loss_mask`
only; its state is a pytree the loop threads through and checkpoints.
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl import ConfigError
from rl.types import Rollouts


class RewardTransform(NamedTuple):
  init: Callable[[], Any]
  update: Callable[..., tuple[Rollouts, Any]]


def correctness(*, correct: float = 1.0, incorrect: float = 0.0) -> RewardTransform:
  """reward = `correct` for a verified completion, else `incorrect` (replaces the reward)."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    reward = jnp.where(rollouts.correct, correct, incorrect).astype(jnp.float32)
    return rollouts.replace(reward=reward), state

  return RewardTransform(lambda: (), update)


def episode_reward() -> RewardTransform:
  """reward = each rollout's own reward, as its source gave it (an agent episode's reward
  function, rl/agents/rollouts.py); put it first in place of correctness."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    return rollouts, state

  return RewardTransform(lambda: (), update)


def named_chain(transforms: dict[str, RewardTransform]) -> RewardTransform:
  """Apply `transforms` in their (insertion) order; the state is a dict keyed by the same
  names, so it can be read back."""
  named = list(transforms.items())

  def init():
    return {name: t.init() for name, t in named}

  def update(rollouts: Rollouts, state, *, step):
    new_state = {}
    for name, t in named:
      rollouts, new_state[name] = t.update(rollouts, state[name], step=step)
    return rollouts, new_state

  return RewardTransform(init, update)


def format_reward(*, bonus: float = 0.0, penalty: float = -1.0) -> RewardTransform:
  """Adds `bonus` to well-formed completions (the task's `well_formed`) and `penalty` to the
  others, e.g. correctness(correct=1, incorrect=-0.5) + format_reward() gives Laser's
  1 / -0.5 / -1 scores."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    return rollouts.replace(reward=rollouts.reward + jnp.where(
        rollouts.well_formed, bonus, penalty)), state

  return RewardTransform(lambda: (), update)


# ----------------------------------------------------------------------------- group helpers

def _group_min_max(values, rollouts: Rollouts):
  n = rollouts.num_groups
  lo = jax.ops.segment_min(values, rollouts.group_ids, n)
  hi = jax.ops.segment_max(values, rollouts.group_ids, n)
  return lo[rollouts.group_ids], hi[rollouts.group_ids]


def group_accuracy(rollouts: Rollouts):
  """The fraction of correct completions in each completion's group: f32[N]."""
  n = rollouts.num_groups
  hits = jax.ops.segment_sum(rollouts.correct.astype(jnp.float32), rollouts.group_ids, n)
  size = jax.ops.segment_sum(jnp.ones_like(rollouts.reward), rollouts.group_ids, n)
  return (hits / jnp.maximum(size, 1.0))[rollouts.group_ids]


def accuracy_at_least(threshold: float) -> Callable[[Rollouts], jax.Array]:
  """A `masked` predicate: completions whose group accuracy is >= threshold (K2.5 Toggle's
  gate; "train length on prompts the policy already solves")."""
  return lambda rollouts: group_accuracy(rollouts) >= threshold


# ----------------------------------------------------------------------------- length rewards

def k15_length_penalty(*, weight: float = 1.0, warmup_steps: int = 0,
                       ramp_steps: int = 0) -> RewardTransform:
  """Kimi k1.5 length reward (arXiv 2501.12599 sec. 2.3.3), added with a weight:

      lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)    over the group
      len_reward_i = lambda_i if correct else min(0, lambda_i);   0 if all lengths are equal

  Warm-up as in the paper: no penalty for `warmup_steps`, then the weight (reached linearly
  over `ramp_steps`; 0 = at once, the paper's constant penalty). The paper gives no weight
  or switch step.
  """
  ramp = (optax.linear_schedule(0.0, weight, ramp_steps) if ramp_steps
          else optax.constant_schedule(weight))
  schedule = optax.join_schedules([optax.constant_schedule(0.0), ramp], [warmup_steps])

  def update(rollouts: Rollouts, state, *, step):
    length = rollouts.lengths.astype(jnp.float32)
    lo, hi = _group_min_max(length, rollouts)
    lam = jnp.where(hi > lo, 0.5 - (length - lo) / jnp.maximum(hi - lo, 1e-9), 0.0)
    bonus = jnp.where(rollouts.correct, lam, jnp.minimum(0.0, lam))
    return rollouts.replace(reward=rollouts.reward + schedule(step) * bonus), state

  return RewardTransform(lambda: (), update)


def truncation(*, target_length: int, rho: float = 0.0) -> RewardTransform:
  """The reward stands only within the target: reward = rho (<= 0) when length > target
  (the truncation reward of Laser's unified form; ThinkPrune lowers the target by stages)."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    over = rollouts.lengths > target_length
    return rollouts.replace(reward=jnp.where(over, rho, rollouts.reward)), state

  return RewardTransform(lambda: (), update)


def laser(*, target_length: int, alpha: float = 0.5) -> RewardTransform:
  """Laser (arXiv 2505.15612): reward += alpha for a correct completion within the target."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    within = rollouts.correct & (rollouts.lengths <= target_length)
    return rollouts.replace(reward=rollouts.reward + alpha * within), state

  return RewardTransform(lambda: (), update)


def laser_d(*, candidate_lengths: tuple[int, ...], alpha: float = 0.5,
            samples_per_prompt: int = 8) -> RewardTransform:
  """Laser-D: Laser with one target per difficulty bucket of the group accuracy (high >= 2/3,
  medium >= 1/3, low), each the smallest candidate L at which floor(coverage * lower_n) >= 1,
  coverage being the fraction of the bucket's groups with a correct completion within L and
  lower_n = floor(n * 2/3), floor(n / 3), 1. The paper measures coverage on a held-out
  monitoring set; here it is the current batch, and the targets are the transform's state
  (used from the next step on; the largest candidate at first and when none qualifies).
  """
  grid = jnp.asarray(sorted(candidate_lengths), jnp.float32)
  lower_n = jnp.asarray([samples_per_prompt * 2 // 3, samples_per_prompt // 3, 1], jnp.float32)

  def init():
    return {"targets": jnp.full((3,), grid[-1])}

  def update(rollouts: Rollouts, state, *, step):
    del step
    n = rollouts.num_groups
    acc = group_accuracy(rollouts)
    bucket = jnp.where(acc >= 2 / 3, 0, jnp.where(acc >= 1 / 3, 1, 2))
    target = state["targets"][bucket]
    within = rollouts.correct & (rollouts.lengths <= target)
    reward = rollouts.reward + alpha * within
    # Shortest correct completion of each group, and each group's bucket.
    big = jnp.float32(1e9)
    shortest = jax.ops.segment_min(jnp.where(rollouts.correct, rollouts.lengths, big),
                                   rollouts.group_ids, n)
    group_bucket = jax.ops.segment_max(bucket, rollouts.group_ids, n)
    targets = []
    for b in range(3):
      in_bucket = group_bucket == b
      count = jnp.maximum(jnp.sum(in_bucket), 1)
      coverage = jnp.sum(in_bucket[None, :] & (shortest[None, :] <= grid[:, None]), axis=1) / count
      ok = jnp.floor(coverage * lower_n[b]) >= 1
      targets.append(jnp.where(jnp.any(ok), grid[jnp.argmax(ok)], grid[-1]))
    return rollouts.replace(reward=reward), {"targets": jnp.stack(targets)}

  return RewardTransform(init, update)


def dapo_overlong(*, max_length: int, cache_length: int) -> RewardTransform:
  """DAPO overlong reward shaping (arXiv 2503.14476 eq. 13), added to the reward:
  0 up to max_length - cache_length, then falling linearly to -1 at max_length, -1 beyond."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    length = rollouts.lengths.astype(jnp.float32)
    soft = max_length - cache_length
    penalty = jnp.where(length <= soft, 0.0,
                        jnp.where(length <= max_length, (soft - length) / cache_length, -1.0))
    return rollouts.replace(reward=rollouts.reward + penalty), state

  return RewardTransform(lambda: (), update)


def adaptive_target_length(*, quantile: float = 0.5, rho: float = 0.0) -> RewardTransform:
  """A target set per group: correct completions longer than the `quantile` of the group's
  correct lengths get reward `rho`; groups with no correct completion are unchanged."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    length = rollouts.lengths.astype(jnp.float32)
    # Each completion's group quantile over correct lengths; others are NaN and ignored.
    same = rollouts.group_ids[:, None] == rollouts.group_ids[None, :]
    pool = jnp.where(same & rollouts.correct[None, :], length[None, :], jnp.nan)
    target = jnp.nanquantile(pool, quantile, axis=1, method="lower")
    over = rollouts.correct & (length > jnp.nan_to_num(target, nan=jnp.inf))
    return rollouts.replace(reward=jnp.where(over, rho, rollouts.reward)), state

  return RewardTransform(lambda: (), update)


# ----------------------------------------------------------------------------- effort budgets
# Reasoning effort as a budget the policy is trained to obey (Kimi K3's successors, issue 24):
# each record names an effort level in its prompt (rl/effort.py), each (problem, level) has a
# length budget, and a completion over its budget gets a fixed reward whatever its
# correctness, so that the policy learns to fit the level's budget instead of being cut there.

def budget_from_lengths(lengths, multiplier, *, quantile: float):
  """Budgets from sampled lengths: the `quantile` (linear interpolation, numpy's default) of
  each row's lengths times its multiplier. lengths: [R, k]; multiplier: [R] -> f32[R]."""
  return (jnp.quantile(jnp.asarray(lengths, jnp.float32), quantile, axis=-1)
          * jnp.asarray(multiplier, jnp.float32))


def _group_quantile(values, group_ids, num_groups: int, q: float):
  """Each entry's group `q`-quantile of `values` (linear interpolation, as jnp.quantile):
  f32[N]. One sort, not an [N, N] pool."""
  order = jnp.lexsort((values, group_ids))
  ordered = values[order]
  sizes = jax.ops.segment_sum(jnp.ones_like(values), group_ids, num_groups)
  starts = jnp.cumsum(sizes) - sizes
  position = q * jnp.maximum(sizes - 1, 0)
  below = jnp.floor(position)
  last = values.shape[0] - 1
  lo = ordered[jnp.clip((starts + below).astype(jnp.int32), 0, last)]
  hi = ordered[jnp.clip((starts + jnp.ceil(position)).astype(jnp.int32), 0, last)]
  return (lo + (position - below) * (hi - lo))[group_ids]


def tightening(*, loose: float = 2.0, tight: float = 1.0, steps: int = 100,
               hold: int = 0) -> optax.Schedule:
  """The budget multiplier by step, for `effort_budget(schedule=...)`: `loose` for `hold`
  steps, then linearly down to `tight` over `steps` steps, then `tight` (never increasing)."""
  if not loose >= tight > 0 or steps < 0 or hold < 0:
    raise ConfigError(f"tightening needs loose >= tight > 0 and steps, hold >= 0; got "
                     f"loose={loose}, tight={tight}, steps={steps}, hold={hold}")
  return optax.join_schedules([optax.constant_schedule(loose),
                               optax.linear_schedule(loose, tight, steps)], [hold])


def effort_budget(*, levels, multipliers: tuple[float, ...] = (0.5, 1.0, 2.0),
                  quantile: float = 0.5, over_reward: float = 0.0,
                  schedule: Optional[optax.Schedule] = None,
                  budgets=None) -> RewardTransform:
  """Over its budget, a completion's reward is `over_reward` whatever its correctness; at or
  under it, the reward is unchanged:

      reward_i = over_reward  if length_i > budget[record_i] * schedule(step)  else reward_i

  `levels`: i32[R], the effort level of each task.train record (rl.effort.level_ids);
  `multipliers[l]` scales level l's budgets. `budgets`: f32[R], the budget of each record
  (e.g. rl.effort.estimate_budgets at the start of training, K3's way); NaN entries, or all
  when None, are estimated from the record's first group: budget_from_lengths of its
  samples' lengths (k = samples_per_prompt) times its level's multiplier, then fixed. (A
  record first drawn late gets its budget from the policy of then, not of the start.) The
  budgets are the transform's state (`{"budget": f32[R]}`), checkpointed with the loop.
  `schedule` (step -> multiplier of every budget, e.g. `tightening()`: loose, then tight;
  default 1). Needs `Rollouts.record_ids`, which the loop fills. Multipliers, quantile and
  schedule are ours: the reports give no values.
  """
  level_ids = np.asarray(levels, np.int32)
  if level_ids.ndim != 1 or not level_ids.size:
    raise ConfigError(f"effort_budget.levels must be one level id per record, got shape "
                     f"{level_ids.shape}")
  if level_ids.min() < 0 or level_ids.max() >= len(multipliers):
    raise ConfigError(f"effort_budget.levels must lie in [0, {len(multipliers)}) (one "
                     f"multiplier per level, multipliers={tuple(multipliers)}), got "
                     f"[{level_ids.min()}, {level_ids.max()}]")
  if not 0.0 <= quantile <= 1.0:
    raise ConfigError(f"effort_budget.quantile must be in [0, 1], got {quantile}")
  if budgets is not None and np.shape(budgets) != level_ids.shape:
    raise ConfigError(f"effort_budget.budgets must hold one budget per record "
                     f"{level_ids.shape}, got shape {np.shape(budgets)}")
  per_record = jnp.asarray(multipliers, jnp.float32)[level_ids]
  schedule = schedule or optax.constant_schedule(1.0)

  def init():
    return {"budget": jnp.full(level_ids.shape, jnp.nan, jnp.float32) if budgets is None
            else jnp.asarray(budgets, jnp.float32)}

  def update(rollouts: Rollouts, state, *, step):
    if rollouts.record_ids is None:
      raise ValueError("effort_budget needs Rollouts.record_ids (each completion's index in "
                       "task.train); rl.loop fills them")
    record = rollouts.record_ids
    length = rollouts.lengths.astype(jnp.float32)
    estimate = _group_quantile(length, rollouts.group_ids, rollouts.num_groups,
                               quantile) * per_record[record]
    known = state["budget"][record]
    budget = jnp.where(jnp.isnan(known), estimate, known)
    over = length > budget * schedule(step)
    return (rollouts.replace(reward=jnp.where(over, over_reward, rollouts.reward)),
            {"budget": state["budget"].at[record].set(budget)})

  return RewardTransform(init, update)


# ----------------------------------------------------------------------------- masks
# "The Art of Efficient Reasoning" (arXiv 2602.20945; formulas from a secondary summary): a
# masked completion is left out of the loss instead of being given a zero reward.

def mask_incorrect() -> RewardTransform:
  """Only correct completions carry gradient (the "-I" variant)."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    return rollouts.replace(loss_mask=rollouts.loss_mask & rollouts.correct), state

  return RewardTransform(lambda: (), update)


def mask_long_correct(*, target_length: int) -> RewardTransform:
  """Correct completions over the target leave the loss ("-L&C")."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    long_correct = rollouts.correct & (rollouts.lengths > target_length)
    return rollouts.replace(loss_mask=rollouts.loss_mask & ~long_correct), state

  return RewardTransform(lambda: (), update)


def mask_over_length(*, target_length: int) -> RewardTransform:
  """Every completion over the target leaves the loss (DAPO's overlong filtering when the
  target is the generation cap)."""

  def update(rollouts: Rollouts, state, *, step):
    del step
    return rollouts.replace(loss_mask=rollouts.loss_mask & (rollouts.lengths <= target_length)
                            ), state

  return RewardTransform(lambda: (), update)


# ----------------------------------------------------------------------------- wrappers

def masked(inner: RewardTransform, where: Callable[[Rollouts], jax.Array]) -> RewardTransform:
  """Apply `inner` only to the completions where `where(rollouts)` (bool[N]) holds; the
  others keep their reward and loss mask. E.g. a length penalty only for prompts the policy
  already solves: masked(k15_length_penalty(), lambda r: group_accuracy(r) >= 0.5)."""

  def update(rollouts: Rollouts, state, *, step):
    changed, state = inner.update(rollouts, state, step=step)
    keep = where(rollouts)
    return rollouts.replace(reward=jnp.where(keep, changed.reward, rollouts.reward),
                            loss_mask=jnp.where(keep, changed.loss_mask, rollouts.loss_mask)
                            ), state

  return RewardTransform(inner.init, update)


# ----------------------------------------------------------------------------- recipes

def k15(*, length_weight: float = 1.0, warmup_steps: int = 0) -> RewardTransform:
  """Kimi k1.5: 0/1 correctness plus the length penalty after a warm-up."""
  return named_chain({"correctness": correctness(),
                      "length": k15_length_penalty(weight=length_weight,
                                                   warmup_steps=warmup_steps)})


def dapo(*, max_length: int, cache_length: int) -> RewardTransform:
  """DAPO: +1 / -1 correctness (eq. 7) plus overlong shaping (eq. 13)."""
  return named_chain({"correctness": correctness(correct=1.0, incorrect=-1.0),
                      "overlong": dapo_overlong(max_length=max_length,
                                                cache_length=cache_length)})
