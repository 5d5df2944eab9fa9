"""The one record a sampled continuation travels in, from the engine to the batch.

A `Trajectory` is one sample of one prompt: who it is (its task record, its group of samples,
its index there), the tokens so far as the engine generated them and the environment
answered them (a single-turn completion is an episode of one turn), each token's log-prob
under the engine's policy and the weight version that produced it, the driver's bookkeeping
of turns (rl/envs/driver.py advances it in place, partial rollouts keep it in the replay
buffer, rl/replay.py), and, once verified (rl/rollout.py), its text and the verdict. The
batch is made from it (rl/batch.py); reward transforms see its columns as `Rollouts`
(`rollouts_view`).

Owns the record and its views, among them `Episode`, a finished continuation as the engine's
Completion with its turns. It does not own generating, verifying or training.
"""

import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from rl.types import Rollouts
from rollouts.engine import Completion


@dataclasses.dataclass(frozen=True)
class Episode(Completion):
  """A multi-turn continuation as one Completion (token_ids, logprobs with 0 on observation
  tokens, finish_reason, versions, policy_mask), plus:

  turn_ends: for each turn, the index in token_ids one past its last policy token.
  turn_rewards: each turn's reward from the environment (None where it gave none).
  counts: the environment's counters summed over the episode.
  budget_truncated: ended because the episode's token budget (policy tokens, or the room in a
    packed row) was spent.
  """
  turn_ends: tuple[int, ...] = ()
  turn_rewards: tuple[float | None, ...] = ()
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  budget_truncated: bool = False

  @property
  def turns(self) -> int:
    return len(self.turn_ends)

  def turn_reward_tokens(self) -> np.ndarray:
    """f32[n]: each turn's reward on its last policy token, 0 elsewhere (and for None)."""
    out = np.zeros(len(self.token_ids), np.float32)
    for end, reward in zip(self.turn_ends, self.turn_rewards):
      if reward is not None and end > 0:
        out[end - 1] += reward
    return out


@dataclasses.dataclass
class Trajectory:
  """One sample of a prompt, possibly unfinished.

  record: the task record; record_index: its index in task.train (-1: not a train record);
  group: the id of its group (the samples of one prompt, unique within a run's step or, for
  partial rollouts, within the run); sample: its index in the group. (group, sample) is the
  trajectory's own but for an agent episode's branches (rl/agents), which share it: the loop's
  advantages then count the episode once (rl.advantages.per_episode).
  prompt_ids: the prompt's tokens. env_state: the environment's state of the episode.
  token_ids, logprobs, versions, policy_mask: per continuation token (observation tokens an
  environment inserted have log-prob 0 and policy_mask False); policy_count counts the
  policy's. turn_start: where the current turn begins; turn_ends / turn_rewards: per ended
  turn, one past its last policy token and its reward (None: none); counts: the
  environment's counters. finish: None while it runs, then "stop" or "length";
  budget_truncated: a token budget ended it. routed_experts: a mixture's experts of the
  sequence's input tokens from the engine's last call for it (Completion.routed_experts:
  that call's prompt was the whole sequence so far), or None.
  text, correct, well_formed: the verdict, filled by rl.rollout.verify.
  reward: the trajectory's own reward, where its source gives one (an agent episode's,
    rl/agents/rollouts.py); 0 otherwise (reward transforms make it from the verdict).
  """
  record: dict[str, Any]
  prompt_ids: tuple[int, ...]
  env_state: Any = None
  record_index: int = -1
  group: int = 0
  sample: int = 0
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  policy_mask: list[bool] = dataclasses.field(default_factory=list)
  policy_count: int = 0
  turn_start: int = 0
  turn_ends: list[int] = dataclasses.field(default_factory=list)
  turn_rewards: list[float | None] = dataclasses.field(default_factory=list)
  counts: dict[str, int] = dataclasses.field(default_factory=dict)
  finish: str | None = None
  budget_truncated: bool = False
  routed_experts: np.ndarray | None = None
  text: str = ""
  correct: bool = False
  well_formed: bool = False
  reward: float = 0.0

  @property
  def over(self) -> bool:
    return self.finish is not None

  @property
  def truncated(self) -> bool:
    """It did not end on a stop token (a length limit, or still running)."""
    return self.finish != "stop"

  @property
  def affinity(self) -> int:
    """The affinity key of every request of this trajectory (its prompt's server)."""
    return affinity(self.prompt_ids)

  def episode(self) -> Episode:
    """Its continuation as an immutable Episode (finish_reason "abort" while unfinished)."""
    return Episode(np.array(self.token_ids, np.int32), np.array(self.logprobs, np.float32),
                   self.finish or "abort", np.array(self.versions, np.int32),
                   policy_mask=np.array(self.policy_mask, bool),
                   turn_ends=tuple(self.turn_ends), turn_rewards=tuple(self.turn_rewards),
                   counts=dict(self.counts), budget_truncated=self.budget_truncated)

  def token_field(self, name: str) -> np.ndarray | None:
    """A TrainBatch field filled from the trajectory itself (rl.types.optional_field
    "trajectory"), per continuation token: turn_rewards (each turn's reward on its last policy
    token) or versions; or per input token of the whole sequence: routed_experts, -1 on the
    tokens the engine routed after its last report (an environment's last observation), None
    when it reported none."""
    if name == "turn_rewards":
      return self.episode().turn_reward_tokens()
    if name == "versions":
      return np.array(self.versions, np.int32)
    if name == "routed_experts":
      if self.routed_experts is None:
        return None
      routes = np.asarray(self.routed_experts, np.int32)
      out = np.full((len(self.prompt_ids) + len(self.token_ids) - 1,) + routes.shape[1:], -1,
                    np.int32)
      out[:len(routes)] = routes[:len(out)]
      return out
    raise KeyError(f"Trajectory has no per-token field {name!r}")


def affinity(prompt: Sequence[int]) -> int:
  """The affinity key of the requests of a prompt's trajectories (its prefix's server)."""
  return hash(tuple(int(t) for t in prompt)) & 0x7FFFFFFF


def column(trajectories: Sequence[Trajectory], name: str, dtype) -> np.ndarray:
  """One attribute of every trajectory as an array: column(ts, "correct", bool)."""
  return np.array([getattr(t, name) for t in trajectories], dtype)


def rollouts_view(trajectories: Sequence[Trajectory]) -> Rollouts:
  """What reward transforms and advantages see of trajectories laid out group by group: their
  verdicts and lengths (the policy's tokens), their own rewards (0 but for a source that
  gives them: agent episodes) and every loss mask on; group ids 0..G-1 in order of
  appearance."""
  groups: dict[int, int] = {}
  group_ids = [groups.setdefault(t.group, len(groups)) for t in trajectories]
  n = len(trajectories)
  return Rollouts(group_ids=jnp.asarray(np.asarray(group_ids, np.int32)),
                  correct=jnp.asarray(column(trajectories, "correct", bool)),
                  lengths=jnp.asarray(column(trajectories, "policy_count", np.int32)),
                  truncated=jnp.asarray(column(trajectories, "truncated", bool)),
                  well_formed=jnp.asarray(column(trajectories, "well_formed", bool)),
                  reward=jnp.asarray(column(trajectories, "reward", np.float32)),
                  loss_mask=jnp.ones(n, bool),
                  num_groups=len(groups),
                  record_ids=jnp.asarray(column(trajectories, "record_index", np.int32)))
