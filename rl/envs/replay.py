"""The replay buffer of paused episodes: partial rollouts of multi-turn episodes.

With RLConfig.partial_rollouts on an agentic task, an iteration advances every unfinished
episode until its token budget or its lambda is reached (rl.envs.driver.advance pauses at a
wave boundary, mid-turn or between turns). Groups whose episodes are all over are trained
on; the others wait here, saved with the loop state, and resume at the next step with the
new weights (each token keeps the version that produced it). It is rollouts/partial.py's
ReplayBuffer for episodes: the same fixed-size arrays, plus the policy mask and the driver's
bookkeeping of each episode (turn boundaries, per-turn rewards, counters, the environment's
state) as JSON bytes, so an environment's state must be JSON-serialisable (ToolEnvironment's
is None) and fit STATE_BYTES.

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

STATE_BYTES = 1024  # an episode's bookkeeping as JSON: ~100 bytes for ToolEnvironment


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


def _bookkeeping(e: EpisodeState) -> bytes:
  return json.dumps({"turn_start": e.turn_start, "turn_ends": e.turn_ends,
                     "turn_rewards": e.turn_rewards, "counts": e.counts, "finish": e.finish,
                     "budget_truncated": e.budget_truncated, "env_state": e.env_state}).encode()


@flax.struct.dataclass
class EpisodeBuffer:
  """Episodes of groups not yet trained on, as fixed-size arrays (`used` marks rows).
  prompt: i32[capacity, max_prompt]; tokens, versions: i32[capacity, max_tokens]; logprobs:
  f32[capacity, max_tokens]; policy_mask: bool[capacity, max_tokens]; state: u8[capacity,
  STATE_BYTES] (JSON, `state_len` bytes of it); the rest [capacity]."""
  used: jnp.ndarray
  group: jnp.ndarray
  record: jnp.ndarray
  sample: jnp.ndarray
  prompt_len: jnp.ndarray
  length: jnp.ndarray
  state_len: jnp.ndarray
  prompt: jnp.ndarray
  tokens: jnp.ndarray
  logprobs: jnp.ndarray
  versions: jnp.ndarray
  policy_mask: jnp.ndarray
  state: jnp.ndarray

  @classmethod
  def empty(cls, capacity: int, max_prompt: int, max_tokens: int) -> "EpisodeBuffer":
    zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
    return cls(zeros(capacity, dtype=bool), zeros(capacity), zeros(capacity), zeros(capacity),
               zeros(capacity), zeros(capacity), zeros(capacity), zeros(capacity, max_prompt),
               zeros(capacity, max_tokens), zeros(capacity, max_tokens, dtype=np.float32),
               zeros(capacity, max_tokens), zeros(capacity, max_tokens, dtype=bool),
               zeros(capacity, STATE_BYTES, dtype=np.uint8))

  def trajectories(self, records: Sequence[dict]) -> list[PausedEpisode]:
    """The buffered episodes; `records` is the task's train split (records by index)."""
    arrays = {k: np.asarray(v) for k, v in vars(self).items()}
    out = []
    for i in np.flatnonzero(arrays["used"]):
      n, p, s = (int(arrays[key][i]) for key in ("length", "prompt_len", "state_len"))
      book = json.loads(arrays["state"][i, :s].tobytes())
      mask = arrays["policy_mask"][i, :n]
      record = int(arrays["record"][i])
      prompt = tuple(int(x) for x in arrays["prompt"][i, :p])
      state = EpisodeState(
          records[record], prompt, book["env_state"], affinity(prompt),
          token_ids=[int(t) for t in arrays["tokens"][i, :n]],
          logprobs=[float(x) for x in arrays["logprobs"][i, :n]],
          versions=[int(v) for v in arrays["versions"][i, :n]],
          policy_mask=[bool(m) for m in mask], policy_count=int(mask.sum()),
          turn_start=book["turn_start"], turn_ends=book["turn_ends"],
          turn_rewards=book["turn_rewards"], counts=book["counts"], finish=book["finish"],
          budget_truncated=book["budget_truncated"])
      out.append(PausedEpisode(int(arrays["group"][i]), record, int(arrays["sample"][i]),
                               state))
    return out

  def store(self, episodes: Sequence[PausedEpisode]) -> "EpisodeBuffer":
    """A buffer holding exactly `episodes`; raises if they do not fit."""
    capacity, max_prompt = np.asarray(self.prompt).shape
    max_tokens = np.asarray(self.tokens).shape[1]
    if len(episodes) > capacity:
      raise ValueError(f"episode replay buffer: {len(episodes)} episodes waiting, capacity "
                       f"{capacity}; raise RLConfig.replay_capacity or the token budget")
    out = {k: np.array(v) for k, v in vars(EpisodeBuffer.empty(capacity, max_prompt,
                                                                max_tokens)).items()}
    for i, paused in enumerate(episodes):
      e = paused.state
      n, p = len(e.token_ids), len(e.prompt_ids)
      if p > max_prompt or n > max_tokens:
        raise ValueError(f"episode replay buffer: an episode of {p} prompt + {n} tokens does "
                         f"not fit [{max_prompt}, {max_tokens}]")
      try:
        book = _bookkeeping(e)
      except TypeError as error:
        raise TypeError(f"episode replay buffer: the environment's state {e.env_state!r} is "
                        f"not JSON-serialisable ({error}); a paused episode keeps it in the "
                        "checkpoint") from None
      if len(book) > STATE_BYTES:
        raise ValueError(f"episode replay buffer: an episode's state is {len(book)} bytes of "
                         f"JSON, more than rl.envs.replay.STATE_BYTES={STATE_BYTES}")
      out["used"][i] = True
      for key, value in (("group", paused.group), ("record", paused.record),
                         ("sample", paused.sample), ("prompt_len", p), ("length", n),
                         ("state_len", len(book))):
        out[key][i] = value
      out["prompt"][i, :p] = e.prompt_ids
      out["tokens"][i, :n] = e.token_ids
      out["logprobs"][i, :n] = e.logprobs
      out["versions"][i, :n] = e.versions
      out["policy_mask"][i, :n] = e.policy_mask
      out["state"][i, :len(book)] = np.frombuffer(book, np.uint8)
    return EpisodeBuffer(**out)
