"""From a step's trajectories to the packed batches its updates train on.

Owns the per-token view of trajectories: which tokens carry gradient (the policy's, of the
trajectories the reward transforms kept in the loss), each token's advantage, the optional
TrainBatch fields the step reads (rl.types.optional_field: "trajectory" fields from the
trajectories themselves, "teacher" fields from the teachers' scores), and the split into
minibatches of whole groups. Also the sequence KL to a reference that KLReward subtracts from
the reward, which needs the same packing. Packing itself is rl/packing.py.
"""

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl import kl as kl_lib
from rl.config import KLReward, RLConfig
from rl.packing import trajectory_batch, unpack
from rl.trajectory import Trajectory
from rl.types import OPTIONAL_FIELDS, TrainBatch


def train_masks(trajectories: Sequence[Trajectory], keep) -> list[np.ndarray]:
  """Per trajectory, bool[n] over its continuation: the policy's tokens of the trajectories
  `keep` (bool[N], the reward transforms' loss mask) keeps; an environment's observation
  tokens never carry gradient."""
  return [np.asarray(t.policy_mask, bool) & bool(k) for t, k in zip(trajectories, keep)]


def trajectory_fields(trajectories: Sequence[Trajectory], reads) -> dict[str, list]:
  """The optional fields among `reads` that trajectories fill themselves, per trajectory,
  and a mixture's routed_experts whenever the engine reported any (all -1, routed by the
  trainer's router, for a trajectory it reported none of: one finished before a resume)."""
  fields = {name: [t.token_field(name) for t in trajectories] for name in sorted(reads)
            if OPTIONAL_FIELDS[name]["source"] == "trajectory" and name != "routed_experts"}
  routes = [t.token_field("routed_experts") for t in trajectories]
  reported = next((r for r in routes if r is not None), None)
  if reported is not None:
    fields["routed_experts"] = [
        np.full((len(t.prompt_ids) + len(t.token_ids) - 1,) + reported.shape[1:], -1, np.int32)
        if r is None else r for t, r in zip(trajectories, routes)]
  return fields


def record_images(trajectories: Sequence[Trajectory], vision_cfg) -> list[list] | None:
  """Each trajectory's prompt images (its record's `images`) for a vision-language model's
  batch (`vision_cfg`, models.config.VisionConfig), else None."""
  return None if vision_cfg is None else [t.record.get("images") or [] for t in trajectories]


def minibatches(trajectories: Sequence[Trajectory], advantages: np.ndarray, masks: list,
                config: RLConfig, fields: Mapping[str, list] = {},
                vision_cfg=None) -> list[TrainBatch]:
  """The step's TrainBatches (numpy): its groups split into config.minibatches shares of
  whole groups, each packed into rows of config.seq_len (a multiple of row_multiple x
  micro_batches rows). `advantages` f32[N] per trajectory, `masks` from train_masks, `fields`
  per-token optional fields per trajectory (None entries are left out); with a
  vision-language model's `vision_cfg`, the prompts' images."""
  images = record_images(trajectories, vision_cfg)
  group_ids = np.array([t.group for t in trajectories])
  groups = list(dict.fromkeys(group_ids.tolist()))  # in order of appearance
  out = []
  for share_groups in np.array_split(np.asarray(groups), min(config.minibatches, len(groups))):
    share = np.flatnonzero(np.isin(group_ids, share_groups))
    pick = lambda values: [values[i] for i in share]
    batch, _ = trajectory_batch(
        pick([t.prompt_ids for t in trajectories]), pick([t.token_ids for t in trajectories]),
        pick([t.logprobs for t in trajectories]), advantages[share], pick(masks),
        config.seq_len, row_multiple=config.row_multiple * config.micro_batches,
        token_fields={name: pick(values) for name, values in fields.items()},
        images=None if images is None else pick(images), vision_cfg=vision_cfg)
    out.append(batch)
  return out


def sequence_kl(trajectories: Sequence[Trajectory],
                reference_logprobs: Callable[[TrainBatch], np.ndarray], kl: KLReward,
                config: RLConfig, vision_cfg=None) -> jax.Array:
  """sum_t kl(engine_logp_t, ref_logp_t) over each trajectory's policy tokens: f32[N]. The
  engine's log-probs stand for the behaviour policy (they equal the trainer's, see
  logp_diff_*)."""
  lengths = [len(t.prompt_ids) + len(t.token_ids) - 1 for t in trajectories]
  batch, placements = trajectory_batch(
      [t.prompt_ids for t in trajectories], [t.token_ids for t in trajectories],
      [t.logprobs for t in trajectories], [0.0] * len(trajectories),
      [np.asarray(t.policy_mask, bool) for t in trajectories], config.seq_len,
      row_multiple=config.row_multiple, images=record_images(trajectories, vision_cfg),
      vision_cfg=vision_cfg)
  ref_logp = np.asarray(reference_logprobs(jax.tree.map(jnp.asarray, batch)))
  values = np.asarray(kl_lib.ESTIMATORS[kl.estimator](
      jnp.asarray(batch.old_logp), jnp.asarray(ref_logp))) * batch.loss_mask
  return jnp.asarray([x.sum() for x in unpack(values, placements, lengths)], jnp.float32)
