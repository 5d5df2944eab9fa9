"""Reward transforms: optax-style `(init, update)` pairs over `Rollouts`.

Owns how verifier verdicts become scalar rewards, and the combinators. A transform's
`update(rollouts, state, *, step) -> (rollouts, state)` may change `reward` and `loss_mask`
only; its state is a pytree the loop threads through and checkpoints.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

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
