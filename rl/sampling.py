"""Prompt sampling: per-prompt statistics and `(init, update)` transforms that turn them into
sampling weights.

Owns `PromptStats` (attempts, successes and last step seen, per training prompt; part of the
checkpointed loop state), the transforms, and the draw of a step's prompt indices.
"""

from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp


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
  return jax.random.choice(key, weights.shape[0], (num,), replace=False,
                           p=weights / jnp.sum(weights))
