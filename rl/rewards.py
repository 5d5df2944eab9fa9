"""Reward transforms: optax-style `(init, update)` pairs over `Rollouts`.

Owns how verifier verdicts become scalar rewards, and the combinators. A transform's
`update(rollouts, state, *, step) -> (rollouts, state)` may change `reward` and `loss_mask`
only; its state is a pytree the loop threads through and checkpoints.
"""

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp

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
