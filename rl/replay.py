"""The replay buffer of partial rollouts: unfinished trajectories, saved with the loop state.

With partial rollouts (rl.sources.Partial) an iteration pauses before every trajectory is
done; the groups not yet complete wait here and resume at a later step, on newer weights
(each token keeps the version that produced it). A buffer is a pytree of fixed-size arrays,
so that orbax saves it with the loop state: per trajectory its identity (group, record,
sample), tokens, log-probs, versions and policy mask, and the driver's bookkeeping (turn
boundaries, per-turn rewards, counters, the environment's state) as JSON bytes, so an
environment's state must be JSON-serialisable (ToolEnvironment's and OneTurn's are None) and
fit STATE_BYTES.

Owns the buffer. rl/sources.py owns when trajectories go in and come out.
"""

import json
from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from rl.trajectory import Trajectory

STATE_BYTES = 1024  # a trajectory's bookkeeping as JSON: ~100 bytes for ToolEnvironment
_FINISH = {None: 0, "stop": 1, "length": 2}
_FINISH_OF = {code: finish for finish, code in _FINISH.items()}


def _bookkeeping(t: Trajectory) -> bytes:
  return json.dumps({"turn_start": t.turn_start, "turn_ends": t.turn_ends,
                     "turn_rewards": t.turn_rewards, "counts": t.counts,
                     "budget_truncated": t.budget_truncated, "env_state": t.env_state}).encode()


@flax.struct.dataclass
class ReplayBuffer:
  """Trajectories of groups not yet trained on, as fixed-size arrays (`used` marks rows).
  prompt: i32[capacity, max_prompt]; tokens, versions: i32[capacity, max_tokens]; logprobs:
  f32[capacity, max_tokens]; policy_mask: bool[capacity, max_tokens]; state:
  u8[capacity, STATE_BYTES] (the bookkeeping's JSON, `state_len` bytes of it); the rest
  [capacity]."""
  used: jnp.ndarray
  group: jnp.ndarray
  record: jnp.ndarray
  sample: jnp.ndarray
  finish: jnp.ndarray
  prompt_len: jnp.ndarray
  length: jnp.ndarray
  prompt: jnp.ndarray
  tokens: jnp.ndarray
  logprobs: jnp.ndarray
  versions: jnp.ndarray
  policy_mask: jnp.ndarray
  state: jnp.ndarray
  state_len: jnp.ndarray

  @classmethod
  def empty(cls, capacity: int, max_prompt: int, max_tokens: int) -> "ReplayBuffer":
    zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
    return cls(zeros(capacity, dtype=bool), zeros(capacity), zeros(capacity), zeros(capacity),
               zeros(capacity), zeros(capacity), zeros(capacity), zeros(capacity, max_prompt),
               zeros(capacity, max_tokens), zeros(capacity, max_tokens, dtype=np.float32),
               zeros(capacity, max_tokens), zeros(capacity, max_tokens, dtype=bool),
               zeros(capacity, STATE_BYTES, dtype=np.uint8), zeros(capacity))

  def trajectories(self, records) -> list[Trajectory]:
    """The buffered trajectories, in the order stored; `records` is the task's train split
    (records by index)."""
    a = {k: np.asarray(v) for k, v in vars(self).items()}
    out = []
    for i in np.flatnonzero(a["used"]):
      n, p = int(a["length"][i]), int(a["prompt_len"][i])
      book = json.loads(a["state"][i, :a["state_len"][i]].tobytes())
      mask = a["policy_mask"][i, :n]
      index = int(a["record"][i])
      out.append(Trajectory(
          records[index], tuple(int(x) for x in a["prompt"][i, :p]), book["env_state"],
          record_index=index, group=int(a["group"][i]), sample=int(a["sample"][i]),
          token_ids=[int(x) for x in a["tokens"][i, :n]],
          logprobs=[float(x) for x in a["logprobs"][i, :n]],
          versions=[int(v) for v in a["versions"][i, :n]],
          policy_mask=[bool(m) for m in mask], policy_count=int(mask.sum()),
          turn_start=book["turn_start"], turn_ends=book["turn_ends"],
          turn_rewards=book["turn_rewards"], counts=book["counts"],
          finish=_FINISH_OF[int(a["finish"][i])], budget_truncated=book["budget_truncated"]))
    return out

  def store(self, trajectories: Sequence[Trajectory]) -> "ReplayBuffer":
    """A buffer holding exactly `trajectories`; raises if they do not fit."""
    capacity, max_prompt = np.asarray(self.prompt).shape
    max_tokens = np.asarray(self.tokens).shape[1]
    if len(trajectories) > capacity:
      raise ValueError(f"replay buffer: {len(trajectories)} trajectories waiting, capacity "
                       f"{capacity}; raise Partial.replay_capacity or the token budget")
    out = {k: np.array(v) for k, v in vars(ReplayBuffer.empty(capacity, max_prompt,
                                                               max_tokens)).items()}
    for i, t in enumerate(trajectories):
      n, p = len(t.token_ids), len(t.prompt_ids)
      if p > max_prompt or n > max_tokens:
        raise ValueError(f"replay buffer: a trajectory of {p} prompt + {n} continuation "
                         f"tokens does not fit [{max_prompt}, {max_tokens}]")
      try:
        book = _bookkeeping(t)
      except TypeError as error:
        raise TypeError(f"replay buffer: the environment's state {t.env_state!r} is not "
                        f"JSON-serialisable ({error}); a paused episode keeps it in the "
                        "checkpoint") from None
      if len(book) > STATE_BYTES:
        raise ValueError(f"replay buffer: a trajectory's state is {len(book)} bytes of JSON, "
                         f"more than rl.replay.STATE_BYTES={STATE_BYTES}")
      out["used"][i] = True
      for key, value in (("group", t.group), ("record", t.record_index),
                         ("sample", t.sample), ("finish", _FINISH[t.finish]),
                         ("prompt_len", p), ("length", n), ("state_len", len(book))):
        out[key][i] = value
      out["prompt"][i, :p] = t.prompt_ids
      out["tokens"][i, :n] = t.token_ids
      out["logprobs"][i, :n] = t.logprobs
      out["versions"][i, :n] = t.versions
      out["policy_mask"][i, :n] = t.policy_mask
      out["state"][i, :len(book)] = np.frombuffer(book, np.uint8)
    return ReplayBuffer(**out)


def complete_groups(trajectories: Sequence[Trajectory]
                    ) -> tuple[list[list[Trajectory]], list[Trajectory]]:
  """(groups whose every sample is over, oldest group first; the other trajectories)."""
  by_group: dict[int, list[Trajectory]] = {}
  for t in trajectories:
    by_group.setdefault(t.group, []).append(t)
  done, rest = [], []
  for group in sorted(by_group):
    members = sorted(by_group[group], key=lambda t: t.sample)
    (done.append(members) if all(t.over for t in members) else rest.extend(members))
  return done, rest
