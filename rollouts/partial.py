"""Partial rollouts: long trajectories do not hold up an iteration.

Owns when an iteration pauses, and the replay buffer. An iteration sends every unfinished
trajectory (new ones, and ones resumed from the buffer as prompt + partial completion with
`max_new_tokens` reduced by what they already have) and ends in one of two ways:
- Kimi k1.5 (arXiv 2501.12599, sec. 2.6.2): once the completions received hold
  `token_budget` tokens;
- Kimi K3's lambda mode: once ceil(lambda * n) of the iteration's n trajectories have
  finished (stop token or length limit).
The rest are then aborted on the servers and come back with the tokens and log-probs
generated so far (a request that finishes before its abort lands counts as finished, so an
iteration can end with a few more than the count). Every token keeps the weight version that
produced it, so the loss can mask or re-weight tokens of older policies (RLConfig
.offpolicy_tokens). The buffer is a pytree of fixed-size arrays saved with the loop state.
It does not own the aborting (the engine's, through the RolloutEngine protocol) or what the
trainer does with groups.
"""

import dataclasses
import math
from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from rollouts.engine import Completion, RolloutEngine, SamplingParams

UNFINISHED, STOPPED, TRUNCATED = 0, 1, 2
_FINISH = {"stop": STOPPED, "length": TRUNCATED}


@dataclasses.dataclass
class Trajectory:
  """One sample of a group, possibly unfinished. token_ids, logprobs, versions: [n]."""
  group: int  # a group id unique within the run
  record: int  # index of the task record (the prompt)
  sample: int  # index within its group
  prompt_ids: tuple[int, ...]
  token_ids: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish: int = UNFINISHED

  @property
  def finished(self) -> bool:
    return self.finish != UNFINISHED

  def completion(self) -> Completion:
    return Completion(self.token_ids, self.logprobs,
                      "stop" if self.finish == STOPPED else "length", self.versions)


def new_group(group: int, record: int, prompt_ids: Sequence[int], size: int
              ) -> list[Trajectory]:
  empty = lambda dtype: np.zeros(0, dtype)
  return [Trajectory(group, record, s, tuple(prompt_ids), empty(np.int32), empty(np.float32),
                     empty(np.int32)) for s in range(size)]


def finish_target(num_trajectories: int, finish_fraction: float) -> int:
  """How many of an iteration's trajectories must finish before lambda mode pauses it:
  ceil(lambda * n), at least 1 (rounded first, so that 0.3 * 10 is 3, not 4)."""
  return max(1, math.ceil(round(finish_fraction * num_trajectories, 9)))


def run_iteration(engine: RolloutEngine, trajectories: Sequence[Trajectory],
                  sampling: SamplingParams, *, seed: int, token_budget: int = 0,
                  finish_fraction: float = 0.0) -> dict:
  """Advance the unfinished `trajectories` (in place) by one iteration on an engine that can
  abort (Capabilities.abort); returns {"received_tokens", "finished", "aborted"}. It pauses
  once the completions received hold `token_budget` tokens (k1.5), or once
  finish_target(n, `finish_fraction`) of its n unfinished trajectories have finished (K3's
  lambda); give exactly one. `sampling.max_new_tokens` is the whole trajectory's limit, not
  the iteration's."""
  if (token_budget > 0) == (finish_fraction > 0) or not finish_fraction <= 1.0:
    raise ValueError(f"run_iteration: give token_budget > 0 (k1.5) or finish_fraction in "
                     f"(0, 1] (K3's lambda), not both; got token_budget={token_budget}, "
                     f"finish_fraction={finish_fraction}")
  if not engine.capabilities.abort:
    raise ValueError(f"partial rollouts need an engine that can abort requests; "
                     f"{type(engine).__name__} cannot (Capabilities.abort is False)")
  todo = [t for t in trajectories if not t.finished]
  received = finished = 0
  target = finish_target(len(todo), finish_fraction) if finish_fraction else 0

  def pause(_, completion: Completion) -> bool:
    nonlocal received, finished
    received += len(completion.token_ids)
    finished += completion.finish_reason != "abort"
    return finished >= target if finish_fraction else received >= token_budget

  completions = engine.generate(
      [t.prompt_ids + tuple(int(x) for x in t.token_ids) for t in todo], sampling, seed=seed,
      affinity=[hash(t.prompt_ids) & 0x7FFFFFFF for t in todo],
      max_new_tokens=[sampling.max_new_tokens - len(t.token_ids) for t in todo],
      stop_when=pause)
  aborted = 0
  for t, c in zip(todo, completions):
    t.token_ids = np.concatenate([t.token_ids, c.token_ids])
    t.logprobs = np.concatenate([t.logprobs, c.logprobs])
    t.versions = np.concatenate([t.versions, c.versions])
    if c.finish_reason == "abort":
      aborted += 1
    else:
      t.finish = _FINISH[c.finish_reason]
  return {"received_tokens": sum(len(c.token_ids) for c in completions),
          "finished": sum(t.finished for t in todo), "aborted": aborted}


def complete_groups(trajectories: Sequence[Trajectory]) -> tuple[list[list[Trajectory]],
                                                                 list[Trajectory]]:
  """(groups whose every sample finished, oldest group first; the other trajectories)."""
  by_group: dict[int, list[Trajectory]] = {}
  for t in trajectories:
    by_group.setdefault(t.group, []).append(t)
  done, rest = [], []
  for group in sorted(by_group):
    members = sorted(by_group[group], key=lambda t: t.sample)
    (done.append(members) if all(t.finished for t in members) else rest.extend(members))
  return done, rest


@flax.struct.dataclass
class ReplayBuffer:
  """Trajectories of groups not yet trained on, as fixed-size arrays (`used` marks rows).
  prompt: i32[capacity, max_prompt]; tokens, versions: i32[capacity, max_new]; logprobs:
  f32[capacity, max_new]; the rest [capacity]."""
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

  @classmethod
  def empty(cls, capacity: int, max_prompt: int, max_new: int) -> "ReplayBuffer":
    zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
    return cls(zeros(capacity, dtype=bool), zeros(capacity), zeros(capacity), zeros(capacity),
               zeros(capacity), zeros(capacity), zeros(capacity), zeros(capacity, max_prompt),
               zeros(capacity, max_new), zeros(capacity, max_new, dtype=np.float32),
               zeros(capacity, max_new))

  def trajectories(self) -> list[Trajectory]:
    arrays = {k: np.asarray(v) for k, v in vars(self).items()}
    out = []
    for i in np.flatnonzero(arrays["used"]):
      n, p = int(arrays["length"][i]), int(arrays["prompt_len"][i])
      out.append(Trajectory(int(arrays["group"][i]), int(arrays["record"][i]),
                            int(arrays["sample"][i]),
                            tuple(int(x) for x in arrays["prompt"][i, :p]),
                            arrays["tokens"][i, :n].copy(), arrays["logprobs"][i, :n].copy(),
                            arrays["versions"][i, :n].copy(), int(arrays["finish"][i])))
    return out

  def store(self, trajectories: Sequence[Trajectory]) -> "ReplayBuffer":
    """A buffer holding exactly `trajectories`; raises if they do not fit."""
    capacity, max_prompt = np.asarray(self.prompt).shape
    max_new = np.asarray(self.tokens).shape[1]
    if len(trajectories) > capacity:
      raise ValueError(f"replay buffer: {len(trajectories)} trajectories waiting, capacity "
                       f"{capacity}; raise RLConfig.replay_capacity or the token budget")
    out = {k: np.array(v) for k, v in vars(ReplayBuffer.empty(capacity, max_prompt,
                                                               max_new)).items()}
    for i, t in enumerate(trajectories):
      n, p = len(t.token_ids), len(t.prompt_ids)
      if p > max_prompt or n > max_new:
        raise ValueError(f"replay buffer: a trajectory of {p} prompt + {n} completion tokens "
                         f"does not fit [{max_prompt}, {max_new}]")
      out["used"][i] = True
      for key, value in (("group", t.group), ("record", t.record), ("sample", t.sample),
                         ("finish", t.finish), ("prompt_len", p), ("length", n)):
        out[key][i] = value
      out["prompt"][i, :p] = t.prompt_ids
      out["tokens"][i, :n] = t.token_ids
      out["logprobs"][i, :n] = t.logprobs
      out["versions"][i, :n] = t.versions
    return ReplayBuffer(**out)
