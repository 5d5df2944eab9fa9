"""Reward transforms: each documented case, by hand."""

import jax
import jax.numpy as jnp
import numpy as np

from rl import rewards
from rl.types import Rollouts


def _rollouts(correct, lengths, groups=None, well_formed=None, reward=None):
  n = len(correct)
  groups = [0] * n if groups is None else groups
  return Rollouts(group_ids=jnp.asarray(groups), correct=jnp.asarray(correct, bool),
                  lengths=jnp.asarray(lengths), truncated=jnp.zeros(n, bool),
                  well_formed=jnp.asarray([True] * n if well_formed is None else well_formed),
                  reward=jnp.asarray([0.0] * n if reward is None else reward, jnp.float32),
                  loss_mask=jnp.ones(n, bool), num_groups=max(groups) + 1)


def _apply(transform, rollouts, step=0):
  out, _ = transform.update(rollouts, transform.init(), step=step)
  return np.asarray(out.reward), np.asarray(out.loss_mask)


def test_k15_length_penalty_documented_cases():
  t = rewards.k15_length_penalty()
  # lengths 10 (shortest) .. 30 (longest): lambda = 0.5, 0, -0.5
  reward, _ = _apply(t, _rollouts([True, True, False, False], [10, 20, 30, 10]))
  np.testing.assert_allclose(reward, [0.5, 0.0, -0.5, 0.0])  # incorrect: min(0, lambda)
  reward, _ = _apply(t, _rollouts([True, False], [7, 7]))
  np.testing.assert_allclose(reward, [0.0, 0.0])  # all lengths equal
  # Groups are separate: each has its own min and max.
  reward, _ = _apply(t, _rollouts([True, True, True, True], [10, 20, 100, 200], [0, 0, 1, 1]))
  np.testing.assert_allclose(reward, [0.5, -0.5, 0.5, -0.5])


def test_k15_warmup_and_ramp():
  r = _rollouts([True, True], [10, 20])
  t = rewards.k15_length_penalty(weight=2.0, warmup_steps=5)
  assert _apply(t, r, step=4)[0].tolist() == [0.0, 0.0]
  np.testing.assert_allclose(_apply(t, r, step=5)[0], [1.0, -1.0])
  ramped = rewards.k15_length_penalty(weight=2.0, warmup_steps=5, ramp_steps=10)
  np.testing.assert_allclose(_apply(ramped, r, step=10)[0], [0.5, -0.5])
  np.testing.assert_allclose(_apply(ramped, r, step=100)[0], [1.0, -1.0])


def test_truncation_laser_and_overlong():
  r = _rollouts([True, True, False], [5, 15, 5], reward=[1.0, 1.0, 0.0])
  np.testing.assert_allclose(_apply(rewards.truncation(target_length=10, rho=-0.2), r)[0],
                             [1.0, -0.2, 0.0])
  np.testing.assert_allclose(_apply(rewards.laser(target_length=10, alpha=0.5), r)[0],
                             [1.5, 1.0, 0.0])
  over = _rollouts([True] * 5, [10, 12, 14, 16, 17])
  np.testing.assert_allclose(
      _apply(rewards.dapo_overlong(max_length=16, cache_length=4), over)[0],
      [0.0, 0.0, -0.5, -1.0, -1.0])


def test_adaptive_target_length_is_a_quantile_of_correct_lengths():
  r = _rollouts([True, True, True, False, True, False], [10, 20, 30, 5, 40, 99],
                [0, 0, 0, 0, 1, 1], reward=[1, 1, 1, 0, 1, 0])
  reward, _ = _apply(rewards.adaptive_target_length(quantile=0.5), r)
  # group 0 correct lengths 10, 20, 30 -> target 20: the 30 loses its reward; group 1 keeps.
  np.testing.assert_allclose(reward, [1, 1, 0, 0, 1, 0])


def test_masks():
  r = _rollouts([True, False, True, False], [5, 5, 50, 50])
  assert _apply(rewards.mask_incorrect(), r)[1].tolist() == [True, False, True, False]
  assert _apply(rewards.mask_long_correct(target_length=10), r)[1].tolist() == [
      True, True, False, True]
  assert _apply(rewards.mask_over_length(target_length=10), r)[1].tolist() == [
      True, True, False, False]


def test_format_reward_and_masked_wrapper():
  r = _rollouts([True, False, False], [3, 3, 3], well_formed=[True, True, False],
                reward=[1.0, -0.5, -0.5])
  np.testing.assert_allclose(_apply(rewards.format_reward(), r)[0], [1.0, -0.5, -1.5])
  # Only groups with accuracy >= 0.5 get the length penalty (group 1 is all wrong).
  r = _rollouts([True, False, False, False], [10, 20, 10, 20], [0, 0, 1, 1])
  gated = rewards.masked(rewards.k15_length_penalty(), rewards.accuracy_at_least(0.5))
  np.testing.assert_allclose(_apply(gated, r)[0], [0.5, -0.5, 0.0, 0.0])


def test_laser_d_picks_the_smallest_covering_target_per_bucket():
  t = rewards.laser_d(candidate_lengths=(10, 20, 30), samples_per_prompt=3)
  # group 0: 3/3 correct (high), shortest correct 15; group 1: 1/3 (medium), shortest 25.
  r = _rollouts([True, True, True, True, False, False], [15, 18, 40, 25, 5, 5],
                [0, 0, 0, 1, 1, 1])
  out, state = t.update(r, t.init(), step=0)
  np.testing.assert_allclose(out.reward, [0.5, 0.5, 0.0, 0.5, 0.0, 0.0])  # first: target 30
  np.testing.assert_allclose(state["targets"], [20, 30, 30])  # high, medium, low (none seen)
  out, _ = t.update(r, state, step=1)
  np.testing.assert_allclose(out.reward, [0.5, 0.5, 0.0, 0.5, 0.0, 0.0])


def test_recipes_and_jit():
  r = _rollouts([True, False, True], [10, 20, 30])
  k15 = rewards.k15(length_weight=1.0)
  reward, _ = _apply(k15, r)
  np.testing.assert_allclose(reward, [1.5, -0.0, 0.5])  # 1 + 0.5 ; 0 + min(0, 0) ; 1 - 0.5
  dapo = rewards.dapo(max_length=30, cache_length=10)
  np.testing.assert_allclose(_apply(dapo, r)[0], [1.0, -1.0, 0.0])
  jitted = jax.jit(lambda x, s: k15.update(x, s, step=3))
  np.testing.assert_allclose(jitted(r, k15.init())[0].reward, reward, atol=1e-6)
