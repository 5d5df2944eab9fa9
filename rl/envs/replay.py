"""The replay buffer of paused episodes: partial rollouts of multi-turn episodes.

With RLConfig.partial_rollouts on an agentic task, an iteration advances every unfinished
episode until its token budget or its lambda is reached (rl.envs.driver.advance pauses at a
wave boundary, mid-turn or between turns). Groups whose episodes are all over are trained
on; the others wait here, saved with the loop state, and resume at the next step with the
new weights (each token keeps the version that produced it). The tokens, log-probs, versions
and group of each episode go into rollouts/partial.py's ReplayBuffer, as single-turn
trajectories do; beside it, row for row, the policy mask and the driver's bookkeeping
(turn boundaries, per-turn rewards, counters, the environment's state) as JSON bytes, so an
environment's state must be JSON-serialisable (ToolEnvironment's is None) and fit
STATE_BYTES.

Owns the buffer and PausedEpisode; the loop (rl/loop.py) owns when groups are trained.
"""

import dataclasses
import json
from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from rl.envs.base import Episode
from rl.envs.driver import EpisodeState, affinity
from rollouts import partial

STATE_BYTES = 1024  # an episode's bookkeeping as JSON: ~100 bytes for ToolEnvironment
_FINISH = {None: partial.UNFINISHED, "stop": partial.STOPPED, "length": partial.TRUNCATED}
_FINISH_OF = {code: finish for finish, code in _FINISH.items()}


@dataclasses.dataclass
class PausedEpisode:
  """One sample of a group of episodes: `state` is advanced in place by the driver."""
  group: int  # a group id unique within the run
  record: int  # index of the task's train record
  sample: int  # index within its group
  state: EpisodeState

  @property
  def finished(self) -> bool:
    return self.state.over

  @property
  def prompt_ids(self) -> tuple[int, ...]:
    return self.state.prompt_ids

  @property
  def versions(self) -> np.ndarray:
    return np.array(self.state.versions, np.int32)

  def completion(self) -> Episode:
    return self.state.episode()

  def trajectory(self) -> partial.Trajectory:
    """Its tokens as a single-turn trajectory (what partial.ReplayBuffer stores)."""
    e = self.state
    return partial.Trajectory(self.group, self.record, self.sample, e.prompt_ids,
                              np.array(e.token_ids, np.int32),
                              np.array(e.logprobs, np.float32), self.versions,
                              _FINISH[e.finish])


def _bookkeeping(e: EpisodeState) -> bytes:
  return json.dumps({"turn_start": e.turn_start, "turn_ends": e.turn_ends,
                     "turn_rewards": e.turn_rewards, "counts": e.counts,
                     "budget_truncated": e.budget_truncated, "env_state": e.env_state}).encode()


@flax.struct.dataclass
class EpisodeBuffer:
  """Episodes of groups not yet trained on, as fixed-size arrays. tokens: their tokens,
  log-probs, versions, groups and finish as single-turn trajectories; row for row beside it,
  policy_mask: bool[capacity, max_tokens] and state: u8[capacity, STATE_BYTES] (the
  bookkeeping's JSON, `state_len` i32[capacity] bytes of it)."""
  tokens: partial.ReplayBuffer
  policy_mask: jnp.ndarray
  state: jnp.ndarray
  state_len: jnp.ndarray

  @classmethod
  def empty(cls, capacity: int, max_prompt: int, max_tokens: int) -> "EpisodeBuffer":
    return cls(partial.ReplayBuffer.empty(capacity, max_prompt, max_tokens),
               np.zeros((capacity, max_tokens), bool),
               np.zeros((capacity, STATE_BYTES), np.uint8), np.zeros(capacity, np.int32))

  def trajectories(self, records: Sequence[dict]) -> list[PausedEpisode]:
    """The buffered episodes; `records` is the task's train split (records by index)."""
    masks, states = np.asarray(self.policy_mask), np.asarray(self.state)
    lengths = np.asarray(self.state_len)
    out = []
    # ReplayBuffer.store fills rows 0..n-1 in order, and so does `store` below.
    for i, t in enumerate(self.tokens.trajectories()):
      book = json.loads(states[i, :lengths[i]].tobytes())
      mask = masks[i, :len(t.token_ids)]
      state = EpisodeState(
          records[t.record], t.prompt_ids, book["env_state"], affinity(t.prompt_ids),
          token_ids=[int(x) for x in t.token_ids], logprobs=[float(x) for x in t.logprobs],
          versions=[int(v) for v in t.versions], policy_mask=[bool(m) for m in mask],
          policy_count=int(mask.sum()), turn_start=book["turn_start"],
          turn_ends=book["turn_ends"], turn_rewards=book["turn_rewards"],
          counts=book["counts"], finish=_FINISH_OF[t.finish],
          budget_truncated=book["budget_truncated"])
      out.append(PausedEpisode(t.group, t.record, t.sample, state))
    return out

  def store(self, episodes: Sequence[PausedEpisode]) -> "EpisodeBuffer":
    """A buffer holding exactly `episodes`; raises if they do not fit."""
    tokens = self.tokens.store([paused.trajectory() for paused in episodes])
    masks = np.zeros(self.policy_mask.shape, bool)
    states = np.zeros(self.state.shape, np.uint8)
    lengths = np.zeros(self.state_len.shape, np.int32)
    for i, paused in enumerate(episodes):
      try:
        book = _bookkeeping(paused.state)
      except TypeError as error:
        raise TypeError(f"episode replay buffer: the environment's state "
                        f"{paused.state.env_state!r} is not JSON-serialisable ({error}); a "
                        "paused episode keeps it in the checkpoint") from None
      if len(book) > STATE_BYTES:
        raise ValueError(f"episode replay buffer: an episode's state is {len(book)} bytes of "
                         f"JSON, more than rl.envs.replay.STATE_BYTES={STATE_BYTES}")
      masks[i, :len(paused.state.policy_mask)] = paused.state.policy_mask
      states[i, :len(book)] = np.frombuffer(book, np.uint8)
      lengths[i] = len(book)
    return EpisodeBuffer(tokens, masks, states, lengths)
