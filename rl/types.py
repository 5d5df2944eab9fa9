"""The pytrees that flow through an RL step, with the shape of every field.

Owns `Rollouts` (one entry per completion, what reward transforms and advantages see) and
`TrainBatch` (packed fixed-shape rows, what the train step and losses see).
"""

from typing import Optional

import flax.struct
import jax


@flax.struct.dataclass
class Rollouts:
  """Per-completion scalars of one RL step; N completions in groups of one prompt each.

  group_ids: i32[N] index of the completion's prompt within the step (0..num_groups-1).
  correct: bool[N] the verifier's verdict.
  lengths: i32[N] completion length in tokens.
  truncated: bool[N] generation hit max_new_tokens without a stop token.
  well_formed: bool[N] the task's format check (e.g. an answer in the expected place).
  reward: f32[N] the scalar outcome reward (reward transforms write it).
  loss_mask: bool[N] False excludes the whole completion from the gradient.
  """

  group_ids: jax.Array
  correct: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  well_formed: jax.Array
  reward: jax.Array
  loss_mask: jax.Array
  num_groups: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class TrainBatch:
  """Packed rows; a row holds several trajectories told apart by segment id.

  tokens: i32[rows, seq] inputs; targets: i32[rows, seq] the next token at each position.
  positions: i32[rows, seq] restart at 0 in each segment.
  segment_ids: i32[rows, seq] 1, 2, ... per trajectory in a row; 0 is padding.
  loss_mask: f32[rows, seq] 1 on completion targets that carry gradient.
  old_logp: f32[rows, seq] behaviour-policy log-prob of each target (the engine's).
  advantages: f32[rows, seq] the trajectory's advantage on each of its tokens.
  ref_logp: f32[rows, seq] reference-policy log-prob, filled by the train step when a loss
    uses a KL to a reference; None otherwise.
  """

  tokens: jax.Array
  targets: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  loss_mask: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  ref_logp: Optional[jax.Array] = None
