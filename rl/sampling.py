"""Prompt sampling: per-prompt statistics and `(init, update)` transforms that turn them into
sampling weights.

Owns `PromptStats` (attempts, successes and last step seen, per training prompt; part of the
checkpointed loop state), the transforms, and the draw of a step's prompt indices.
"""

from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class PromptStats:
  """attempts, successes: i32[num_prompts] completions sampled / verified correct so far;
  last_seen: i32[num_prompts] the last step the prompt was drawn (-1: never)."""

  attempts: jax.Array
  successes: jax.Array
  last_seen: jax.Array

  @classmethod
  def create(cls, num_prompts: int) -> "PromptStats":
    zeros = jnp.zeros((num_prompts,), jnp.int32)
    return cls(zeros, zeros, jnp.full((num_prompts,), -1, jnp.int32))

  def record(self, indices, attempts, successes, *, step: int) -> "PromptStats":
    """Add one step's outcome: indices, attempts, successes: i32[batch]."""
    return PromptStats(self.attempts.at[indices].add(attempts),
                       self.successes.at[indices].add(successes),
                       self.last_seen.at[indices].set(step))


class SamplingTransform(NamedTuple):
  """init(num_prompts) -> state; update(stats, state, *, step) -> (weights f32[N], state)."""
  init: Callable[[int], Any]
  update: Callable[..., tuple[jax.Array, Any]]


def uniform() -> SamplingTransform:
  """Every prompt equally likely."""

  def update(stats: PromptStats, state, *, step):
    del step
    return jnp.ones(stats.attempts.shape, jnp.float32), state

  return SamplingTransform(lambda num_prompts: (), update)


def draw(key, weights, num: int):
  """`num` distinct prompt indices, with probability proportional to weights f32[N]."""
  if num > weights.shape[0]:
    raise ValueError(f"cannot draw {num} distinct prompts from {weights.shape[0]}")
  available = int(jnp.sum(weights > 0))
  if available < num:
    raise ValueError(f"the sampling transforms leave {available} prompts with a non-zero "
                     f"weight, fewer than the {num} a step draws; widen the filters")
  return jax.random.choice(key, weights.shape[0], (num,), replace=False,
                           p=weights / jnp.sum(weights))


def pass_rates(stats: PromptStats, *, unseen: float = 0.0):
  """Cumulative success rate per prompt, successes / attempts; `unseen` where never drawn."""
  return jnp.where(stats.attempts > 0, stats.successes / jnp.maximum(stats.attempts, 1), unseen)


def prioritized(*, unseen: float = 0.0, floor: float = 1e-3) -> SamplingTransform:
  """Kimi k1.5 prioritized sampling (sec. 2.3.4): weight 1 - s_i, s_i the cumulative success
  rate. The paper leaves open what we set here: unseen prompts count as s = `unseen` (0: drawn
  first), and weights never drop below `floor`, so solved prompts stay drawable and an
  all-solved set does not divide by zero."""

  def update(stats: PromptStats, state, *, step):
    del step
    return jnp.maximum(1.0 - pass_rates(stats, unseen=unseen), floor), state

  return SamplingTransform(lambda num_prompts: (), update)


def pass_rate_band(*, low: float = 0.0, high: float = 1.0,
                   keep_unseen: bool = True) -> SamplingTransform:
  """Keep prompts whose pass rate lies in [low, high] (e.g. [0.5, 1] for "easy prompts keep
  the positive-reward density", or (0, 1) exclusive of the ends via 1e-6 margins); prompts
  never drawn are kept unless keep_unseen is False."""

  def update(stats: PromptStats, state, *, step):
    del step
    rate = pass_rates(stats)
    inside = (rate >= low) & (rate <= high)
    keep = jnp.where(stats.attempts > 0, inside, keep_unseen)
    return keep.astype(jnp.float32), state

  return SamplingTransform(lambda num_prompts: (), update)


def curriculum(*, lowest: optax.Schedule = optax.constant_schedule(0.0),
               highest: optax.Schedule = optax.constant_schedule(1.0),
               difficulty: jax.Array | None = None, unseen: float = 0.5) -> SamplingTransform:
  """Keep prompts whose difficulty in [0, 1] lies in [lowest(step), highest(step)].

  Difficulty is `difficulty` f32[N] when given (a dataset field, see `field_difficulty`),
  else the measured 1 - pass rate (`unseen` for prompts never drawn). Easy first, then hard:
  raise `highest` over steps; k1.5's ablation (all, then only hard): raise `lowest`.
  """

  def update(stats: PromptStats, state, *, step):
    d = 1.0 - pass_rates(stats, unseen=1.0 - unseen) if difficulty is None else difficulty
    keep = (d >= lowest(step)) & (d <= highest(step))
    return keep.astype(jnp.float32), state

  return SamplingTransform(lambda num_prompts: (), update)


def field_difficulty(task, field: str):
  """A record field of task.train rescaled to [0, 1] (min -> 0, max -> 1): f32[N]."""
  values = jnp.asarray([float(task.train[i][field]) for i in range(len(task.train))])
  span = jnp.maximum(values.max() - values.min(), 1e-9)
  return (values - values.min()) / span


def named_chain(transforms: dict[str, SamplingTransform]) -> SamplingTransform:
  """Multiply the weights of `transforms` (filters are 0/1 weights); state keyed by name."""

  def init(num_prompts):
    return {name: t.init(num_prompts) for name, t in transforms.items()}

  def update(stats: PromptStats, state, *, step):
    weights, new_state = jnp.ones(stats.attempts.shape, jnp.float32), {}
    for name, t in transforms.items():
      w, new_state[name] = t.update(stats, state[name], step=step)
      weights = weights * w
    return weights, new_state

  return SamplingTransform(init, update)
