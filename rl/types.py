"""The pytrees that flow through an RL step, with the shape of every field.

Owns `Rollouts` (one entry per completion, what reward transforms and advantages see) and
`TrainBatch` (packed fixed-shape rows, what the train step and losses see), whose optional
fields are declared once, here, with who fills them.
"""

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp


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
  record_ids: i32[N] index of the completion's record in task.train (the loop fills it; per-
    record transforms such as rewards.effort_budget read it), or None.
  """

  group_ids: jax.Array
  correct: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  well_formed: jax.Array
  reward: jax.Array
  loss_mask: jax.Array
  num_groups: int = flax.struct.field(pytree_node=False, default=0)
  record_ids: Optional[jax.Array] = None


def optional_field(source: str, *, dtype=jnp.float32, top_k: bool = False):
  """A TrainBatch field that is None unless a piece of the step reads it (a loss or an
  off-policy correction names it in its `reads`; routed_experts whenever the engine reports
  them): per token [rows, seq], with a trailing top-k axis when `top_k`. `source` says who fills it:
    "trajectory": the rollout itself (rl.rollout.Trajectory.token_field),
    "teacher":    the teachers' scoring of each trajectory (rl/distill.py),
    "reference":  the train step, from the reference policy's params,
    "train_step": the train step, from the current policy (with gradient)."""
  return flax.struct.field(default=None, metadata={"source": source, "dtype": dtype,
                                                    "top_k": top_k})


@flax.struct.dataclass
class TrainBatch:
  """Packed rows; a row holds several trajectories told apart by segment id.

  tokens: i32[rows, seq] inputs; targets: i32[rows, seq] the next token at each position.
  positions: i32[rows, seq] restart at 0 in each segment.
  segment_ids: i32[rows, seq] 1, 2, ... per trajectory in a row; 0 is padding.
  loss_mask: f32[rows, seq] 1 on completion targets that carry gradient.
  old_logp: f32[rows, seq] behaviour-policy log-prob of each target (the engine's).
  advantages: f32[rows, seq] the trajectory's advantage on each of its tokens.

  The optional fields (`optional_field`: None unless read) are the one place a new
  per-token quantity is declared:
  ref_logp: f32[rows, seq] reference-policy log-prob (a loss with a KL to a reference).
  teacher_logp: f32[rows, seq] the teacher's log-prob of each completion target (on-policy
    distillation: a teacher engine scores the student's trajectories).
  teacher_topk_ids, teacher_topk_logp: i32 / f32[rows, seq, k] the teacher's k most likely
    next tokens at each completion target and their log-probs (top-k distillation).
  student_topk_logp: f32[rows, seq, k] the current policy's log-probs of those tokens,
    filled by the train step (with gradient) when the teacher's are present.
  turn_rewards: f32[rows, seq] a multi-turn episode's per-turn rewards, each on the target of
    its turn's last policy token (0 elsewhere and for single-turn completions).
  versions: i32[rows, seq] the weight version that generated each completion target (the
    off-policy corrections of rl/corrections.py compare it with the step's).
  routed_experts: i32[rows, seq, sparse layers, k] the experts a mixture's engine sent each
    input token to (-1: not reported; 0 on padding), carried whenever the engine reports
    them: the train step measures how often its router differs and, with routing replay,
    routes the tokens the same way (rl.train_step.make_train_step).

  A vision-language model's batch of trajectories with images has `images`, each row's images
  in the order of its image tokens (models.vision.Images with a leading rows axis), and
  positions i32[rows, seq, 3] (multimodal RoPE: models.vision.sequence_positions).
  """

  tokens: jax.Array
  targets: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  loss_mask: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  ref_logp: Optional[jax.Array] = optional_field("reference")
  teacher_logp: Optional[jax.Array] = optional_field("teacher")
  teacher_topk_ids: Optional[jax.Array] = optional_field("teacher", dtype=jnp.int32,
                                                         top_k=True)
  teacher_topk_logp: Optional[jax.Array] = optional_field("teacher", top_k=True)
  student_topk_logp: Optional[jax.Array] = optional_field("train_step", top_k=True)
  turn_rewards: Optional[jax.Array] = optional_field("trajectory")
  versions: Optional[jax.Array] = optional_field("trajectory", dtype=jnp.int32)
  routed_experts: Optional[jax.Array] = optional_field("trajectory", dtype=jnp.int32)
  images: Optional[Any] = None


# name -> metadata (source, dtype, top_k) of every optional TrainBatch field.
OPTIONAL_FIELDS = {f.name: f.metadata for f in dataclasses.fields(TrainBatch)
                   if "source" in f.metadata}
