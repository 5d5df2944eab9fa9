"""Group baselines: every completion is compared with the others sampled for its prompt.

Each function maps rewards f32[N] and group_ids i32[N] (0..num_groups-1) to advantages f32[N];
the packer broadcasts them to the completion's tokens. Registered by name so that a loss
names the estimator it is defined with.
"""

import jax
import jax.numpy as jnp
import numpy as np


def _group_stats(reward, group_ids, num_groups):
  count = jax.ops.segment_sum(jnp.ones_like(reward), group_ids, num_groups)
  mean = jax.ops.segment_sum(reward, group_ids, num_groups) / jnp.maximum(count, 1)
  return count, mean


def mean_baseline(reward, group_ids, num_groups: int):
  """r_i - mean_j r_j, the mean over the whole group with i included (Kimi k1.5 sec. 2.3.2,
  Dr.GRPO)."""
  _, mean = _group_stats(reward, group_ids, num_groups)
  return reward - mean[group_ids]


def group_normalized(reward, group_ids, num_groups: int, *, eps: float = 1e-6):
  """(r_i - mean) / (std + eps) with the unbiased std (GRPO, arXiv 2402.03300; eps as verl,
  TRL uses 1e-4). A singleton group uses mean 0 and std 1, as verl does."""
  count, mean = _group_stats(reward, group_ids, num_groups)
  sq = jax.ops.segment_sum(jnp.square(reward - mean[group_ids]), group_ids, num_groups)
  std = jnp.sqrt(sq / jnp.maximum(count - 1, 1))
  single = count[group_ids] <= 1
  mean_i = jnp.where(single, 0.0, mean[group_ids])
  std_i = jnp.where(single, 1.0, std[group_ids])
  return (reward - mean_i) / (std_i + eps)


def leave_one_out(reward, group_ids, num_groups: int):
  """r_i - mean_{j != i} r_j (RLOO; = n/(n-1) (r_i - mean)). A singleton group uses 0 as its
  baseline."""
  count, mean = _group_stats(reward, group_ids, num_groups)
  n = count[group_ids]
  return jnp.where(n > 1, (reward - mean[group_ids]) * n / jnp.maximum(n - 1, 1), reward)


def success_indicator(reward, group_ids, num_groups: int, *, threshold: float = 1.0):
  """1[r_i >= threshold]: the positive-only weight of ReST / rejection-sampling fine-tuning."""
  del group_ids, num_groups
  return (reward >= threshold).astype(jnp.float32)


def per_episode(estimator, reward, group_ids, num_groups: int, episode_ids) -> jax.Array:
  """Advantages of episodes made of several trajectories (an agent episode's branches,
  rl/agents: one per branch of its conversation), `episode_ids` i32[N] naming each one's:
  the estimator over episodes, each counted once with its branches' mean reward, and each
  branch given its episode's advantage divided by the episode's branch count, so that an
  episode of many branches weighs in its group's baseline and in the loss as one of one."""
  episode_ids = np.asarray(episode_ids)
  _, first, inverse, counts = np.unique(episode_ids, return_index=True, return_inverse=True,
                                        return_counts=True)
  episodes = len(counts)
  mean = jax.ops.segment_sum(reward, jnp.asarray(inverse), episodes) / jnp.asarray(counts)
  advantage = estimator(mean, jnp.asarray(group_ids)[first], num_groups)
  return advantage[inverse] / jnp.asarray(counts, jnp.float32)[inverse]


ESTIMATORS = {"mean_baseline": mean_baseline, "group_normalized": group_normalized,
              "leave_one_out": leave_one_out, "success_indicator": success_indicator}
