"""Prompt-sampling transforms over per-prompt statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl import sampling
from rl.tasks.arithmetic import Arithmetic


def _stats():
  # prompts: 0 unseen; 1 solved 0/4; 2 solved 2/4; 3 solved 4/4
  stats = sampling.PromptStats.create(4)
  return stats.record(jnp.asarray([1, 2, 3]), 4, jnp.asarray([0, 2, 4]), step=0)


def _weights(t, step=0):
  return np.asarray(t.update(_stats(), t.init(4), step=step)[0])


def test_prioritized_is_one_minus_success_rate():
  np.testing.assert_allclose(_weights(sampling.prioritized()), [1.0, 1.0, 0.5, 1e-3])
  np.testing.assert_allclose(_weights(sampling.prioritized(unseen=0.5, floor=0.0)),
                             [0.5, 1.0, 0.5, 0.0])


def test_pass_rate_band():
  assert _weights(sampling.pass_rate_band(low=0.25, high=0.75)).tolist() == [1, 0, 1, 0]
  assert _weights(sampling.pass_rate_band(low=0.25, high=1.0, keep_unseen=False)).tolist() == [
      0, 0, 1, 1]


def test_curriculum_by_pass_rate_and_by_field():
  easy_first = sampling.curriculum(highest=optax.linear_schedule(0.0, 1.0, 10))
  assert _weights(easy_first, step=0).tolist() == [0, 0, 0, 1]  # only the solved prompt
  assert _weights(easy_first, step=5).tolist() == [1, 0, 1, 1]  # unseen counts as 0.5
  assert _weights(easy_first, step=10).tolist() == [1, 1, 1, 1]
  task = Arithmetic(digits=3, num_train=50)
  difficulty = sampling.field_difficulty(task, "digits")
  digits = np.array([task.train[i]["digits"] for i in range(50)])
  np.testing.assert_allclose(difficulty, (digits - digits.min()) / (digits.max() - digits.min()))
  hard_later = sampling.curriculum(difficulty=difficulty,
                                   lowest=optax.join_schedules(
                                       [optax.constant_schedule(0.0),
                                        optax.constant_schedule(0.99)], [24]))
  stats = sampling.PromptStats.create(50)
  w0 = np.asarray(hard_later.update(stats, (), step=0)[0])
  w30 = np.asarray(hard_later.update(stats, (), step=30)[0])
  assert w0.all() and (w30 == (digits == 3)).all()


def test_named_chain_multiplies_and_draw_respects_filters():
  chain = sampling.named_chain({"band": sampling.pass_rate_band(low=0.25, high=0.75),
                                "priority": sampling.prioritized()})
  weights, state = chain.update(_stats(), chain.init(4), step=0)
  np.testing.assert_allclose(weights, [1.0, 0.0, 0.5, 0.0])
  assert set(state) == {"band", "priority"}
  drawn = sampling.draw(jax.random.PRNGKey(0), weights, 2)
  assert sorted(np.asarray(drawn).tolist()) == [0, 2]
  with pytest.raises(ValueError, match="leave 2 prompts"):
    sampling.draw(jax.random.PRNGKey(0), weights, 3)


def test_prioritized_draws_follow_the_weights():
  weights = jnp.asarray([0.9, 0.1])
  counts = np.zeros(2)
  for i in range(400):
    counts[int(sampling.draw(jax.random.PRNGKey(i), weights, 1)[0])] += 1
  assert 0.85 < counts[0] / 400 < 0.95
