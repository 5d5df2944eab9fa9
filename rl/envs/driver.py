"""The rollout driver: trajectories of an Environment over any RolloutEngine, one turn or many.

Token-in/token-out. Every request is the prompt plus every token of the trajectory so far,
exactly as the engine generated them or the environment answered them; nothing is
re-tokenised, so the trajectory is what the policy saw and the trainer's log-probs of it are
the engine's. A single-turn task runs here as the one-turn environment (rl.envs.OneTurn):
one wave, one engine call, nothing observed.

Waves. All active trajectories advance together: each wave is one engine.generate call
holding every active trajectory with the tokens it may still generate (`max_new_tokens` per
prompt; the embedded engine buckets them into a few shapes), and the environment answers each
turn that ended as soon as the engine hands it over (on `workers` threads, several episodes
at once, tool calls overlapping the rest of the wave). An episode that is over frees its slot,
and a waiting one (beyond `max_in_flight`) takes it at the next wave. What this promises: the
turns of different episodes are batched together; no episode waits for another's later turns
or tool calls, only for the wave it is in. Trajectories that are over are handed to `on_over`
in the batches the engine handed them over in (all at once from the embedded engine, one by
one from servers), so their verification overlaps generation.

Stops. A turn ends at a stop token (sampling.stop_token_ids: <eos>), at one of the
environment's stop strings, or at its token budget. A stop string of one token is a stop token.
A longer one stops generation at its last token (as encoded alone), and the turn goes on in
the next wave when its text does not end with the whole string: `<calc>` stops at '>' like
`</calc>` does, and the turn continues. (The alternative, generating to <eos> and cutting at
the string, wastes the tokens after it and needs the engine to discard them.) With a BPE
tokenizer, use stop strings that are special tokens (Qwen's `</tool_call>`) or that end in a
token which cannot merge with the text before it.

Budgets. sampling.max_new_tokens is the episode's budget of policy tokens, all turns together
(what a single-turn completion's length is: length penalties and eval budgets count these);
environment.max_turn_tokens caps one turn; max_sequence_tokens caps prompt + continuation,
policy and observation tokens (what a packed training row holds). Each wave gives a
trajectory the tokens it has left. One out of either episode budget ends truncated ("length",
budget_truncated), its last observation cut to the room left.

SGLang servers: every request of a trajectory carries the same affinity key (its prompt's
hash), so each continuation goes to the server that already holds its prefix in cache.

Pausing (partial rollouts: `Pause`). `advance(..., pause=Pause(token_budget=B))` returns once
the tokens generated since it was called reach B (Kimi k1.5), `Pause(finish_fraction=L)` once
ceil(L * n) of its n unfinished trajectories are over (Kimi K3's lambda). On an engine that can
abort (Capabilities.abort) the rule is checked as each completion arrives and the requests
still running are aborted (they come back with the tokens made so far, and the turn goes on
at the next call); on any engine it is checked between waves. An arrival counts as over for
the lambda rule when it ends the environment's last permitted turn (a single-turn one always
does). Unfinished trajectories keep their state (tokens, log-probs, per-token versions, the
environment's state) and resume where they stopped at the next call, after a weight update
too.
"""

import collections
import concurrent.futures
import dataclasses
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from rl.envs.base import Environment, Episode, Observation, Turn, encode_text
from rl.trajectory import Trajectory
from rollouts.engine import Completion, RolloutEngine, SamplingParams


def start(environment: Environment, records: Sequence[dict],
          prompts: Sequence[Sequence[int]], **identity: Sequence[int]) -> list[Trajectory]:
  """A fresh trajectory per (record, prompt); `identity` may give each its record_index,
  group and sample (sequences as long as `records`)."""
  if len(records) != len(prompts):
    raise ValueError(f"start: {len(records)} records for {len(prompts)} prompts")
  return [Trajectory(record, tuple(int(t) for t in prompt), environment.reset(record),
                     **{name: int(values[i]) for name, values in identity.items()})
          for i, (record, prompt) in enumerate(zip(records, prompts))]


@dataclasses.dataclass(frozen=True)
class Pause:
  """When `advance` pauses: once `token_budget` tokens were generated (Kimi k1.5), or once
  ceil(finish_fraction * n) of its n unfinished trajectories are over (Kimi K3's lambda)."""
  token_budget: int = 0
  finish_fraction: float = 0.0

  def __post_init__(self):
    if (self.token_budget > 0) == (self.finish_fraction > 0) or not self.finish_fraction <= 1:
      raise ValueError(f"Pause: give token_budget > 0 (k1.5) or finish_fraction in (0, 1] "
                       f"(K3's lambda), not both; got token_budget={self.token_budget}, "
                       f"finish_fraction={self.finish_fraction}")


def finish_target(num_trajectories: int, finish_fraction: float) -> int:
  """How many of an iteration's trajectories must finish before lambda mode pauses it:
  ceil(lambda * n), at least 1 (rounded first, so that 0.3 * 10 is 3, not 4)."""
  return max(1, math.ceil(round(finish_fraction * num_trajectories, 9)))


@dataclasses.dataclass(frozen=True)
class _Stops:
  whole: frozenset[int]  # tokens that end a turn by themselves
  last: frozenset[int]  # last tokens of longer stop strings: check the text
  strings: tuple[str, ...]


def _stops(environment: Environment, tokenizer, sampling: SamplingParams) -> _Stops:
  whole, last = set(sampling.stop_token_ids), set()
  for text in environment.stop_strings:
    ids = encode_text(tokenizer, text)
    if not ids:
      raise ValueError(f"stop string {text!r} encodes to no tokens")
    (whole if len(ids) == 1 else last).add(ids[-1])
  return _Stops(frozenset(whole), frozenset(last - whole), tuple(environment.stop_strings))


@dataclasses.dataclass(frozen=True)
class _Limits:
  """The budgets a trajectory generates under."""
  sampling: SamplingParams
  max_turn_tokens: int | None
  max_sequence_tokens: int | None

  def room(self, t: Trajectory) -> int:
    """Tokens the trajectory may still generate under its episode budgets."""
    room = self.sampling.max_new_tokens - t.policy_count
    if self.max_sequence_tokens is not None:
      room = min(room, self.max_sequence_tokens - len(t.prompt_ids) - len(t.token_ids))
    return room

  def allowance(self, t: Trajectory) -> int:
    """Tokens the trajectory may generate now: its episode room and its turn's."""
    room = self.room(t)
    if self.max_turn_tokens is not None:
      room = min(room, self.max_turn_tokens - (len(t.token_ids) - t.turn_start))
    return room


def _turn_ended(t: Trajectory, completion: Completion, stops: _Stops, tokenizer,
                allowance_left: int) -> str | None:
  """"stop" or "length" when the current turn is over after `completion`, else None."""
  if completion.finish_reason == "stop" and len(completion.token_ids):
    last = int(completion.token_ids[-1])
    if last in stops.whole:
      return "stop"
    text = tokenizer.decode(t.token_ids[t.turn_start:])
    if any(text.endswith(s) for s in stops.strings):
      return "stop"
  return "length" if allowance_left < 1 else None


def _extend(t: Trajectory, completion: Completion) -> None:
  n = len(completion.token_ids)
  t.token_ids += [int(x) for x in completion.token_ids]
  t.logprobs += [float(x) for x in completion.logprobs]
  t.versions += [int(v) for v in completion.versions]
  t.policy_mask += [True] * n
  t.policy_count += n
  if completion.routed_experts is not None and n:  # the sequence's inputs so far
    t.routed_experts = completion.routed_experts


def _answer(t: Trajectory, state: Any, observation: Observation, limits: _Limits) -> None:
  """Take the environment's answer to the turn that just ended."""
  t.env_state = state
  t.turn_ends.append(len(t.token_ids))
  t.turn_rewards.append(observation.reward)
  for key, value in observation.counts.items():
    t.counts[key] = t.counts.get(key, 0) + int(value)
  ids = [int(x) for x in observation.token_ids]
  room = len(ids) if limits.max_sequence_tokens is None else max(
      0, limits.max_sequence_tokens - len(t.prompt_ids) - len(t.token_ids))
  cut = len(ids) > room
  ids = ids[:room]
  t.token_ids += ids
  t.logprobs += [0.0] * len(ids)
  t.versions += [t.versions[-1] if t.versions else -1] * len(ids)
  t.policy_mask += [False] * len(ids)
  t.turn_start = len(t.token_ids)
  spent = cut or limits.room(t) < 1
  if observation.done:
    t.finish = "length" if observation.truncated else "stop"
  elif spent:
    t.finish = "length"
  t.budget_truncated = t.finish == "length" and spent


class _Wave:
  """One wave's engine call: takes each completion as it is handed over (on the engine's
  thread), has the environment answer the turns that ended (a batch of them per hand-over, on
  the worker pool), hands over those that are over, and counts what a Pause rule reads."""

  def __init__(self, members: list[Trajectory], environment: Environment, tokenizer,
               stops: _Stops, limits: _Limits, pool, on_over, finished: int):
    self.members, self.environment, self.tokenizer = members, environment, tokenizer
    self.stops, self.limits, self.pool, self.on_over = stops, limits, pool, on_over
    self.allowances = [limits.allowance(t) for t in members]
    self.arrived: set[int] = set()
    self.generated = 0
    self.finished = finished  # over, or ending their last permitted turn
    self.answering = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="answers")
    self.answers: list[concurrent.futures.Future] = []
    self.lock = threading.Lock()

  def hand_over(self, ready: dict[int, Completion]) -> None:
    ended = []
    with self.lock:
      for index, completion in ready.items():
        t, allowance = self.members[index], self.allowances[index]
        self.arrived.add(index)
        completion = completion.cut(allowance)  # for an engine that ignored its limit
        self.generated += len(completion.token_ids)
        _extend(t, completion)
        reason = _turn_ended(t, completion, self.stops, self.tokenizer,
                             self.limits.allowance(t))
        if reason is None:
          continue
        turn = Turn(len(t.turn_ends), np.array(t.token_ids[t.turn_start:], np.int32),
                    self.tokenizer.decode(t.token_ids[t.turn_start:]), reason)
        ended.append((t, turn))
        last = self.environment.max_turns
        self.finished += last is not None and turn.index + 1 >= last
    if ended:
      self.answers.append(self.answering.submit(self._answer_all, ended))

  def _answer_all(self, ended: list[tuple[Trajectory, Turn]]) -> None:
    replies = list(self.pool.map(
        lambda pair: self.environment.step(pair[0].env_state, pair[1], self.tokenizer), ended))
    over = []
    for (t, _), (state, observation) in zip(ended, replies):
      _answer(t, state, observation, self.limits)
      if t.over:
        over.append(t)
    if over and self.on_over is not None:
      self.on_over(over)

  def close(self, returned: int) -> None:
    """Wait for the environment's answers; raise what they raised, or an engine that
    returned `returned` completions without handing each over."""
    self.answering.shutdown(wait=True)
    for future in self.answers:
      future.result()
    if self.arrived != set(range(returned)):
      raise RuntimeError(f"the engine returned {returned} completions but handed over "
                         f"{len(self.arrived)} through on_ready (missing: "
                         f"{sorted(set(range(returned)) - self.arrived)[:8]}); it must hand "
                         "over each once")


def advance(engine: RolloutEngine, environment: Environment, tokenizer,
            trajectories: Sequence[Trajectory], sampling: SamplingParams, *, seed: int,
            max_sequence_tokens: int | None = None, max_in_flight: int | None = None,
            pause: Pause | None = None,
            on_over: Callable[[list[Trajectory]], None] | None = None,
            workers: int = 4) -> dict[str, Any]:
  """Run the unfinished `trajectories` (in place) in waves until every one is over, or until
  `pause` says to pause (call again to resume). `on_over(trajectories)` gets each one as it
  ends (see the module docstring). Wave w draws with seed + 7919 w. Returns {"waves",
  "generated_tokens", "finished", "unfinished", "paused"}."""
  stops = _stops(environment, tokenizer, sampling)
  full_turn = min(sampling.max_new_tokens, environment.max_turn_tokens or sampling.max_new_tokens)
  limits = _Limits(sampling, environment.max_turn_tokens, max_sequence_tokens)
  call = dataclasses.replace(sampling, max_new_tokens=full_turn,
                             stop_token_ids=tuple(sorted(stops.whole | stops.last)))
  waiting = collections.deque(t for t in trajectories if not t.over)
  todo = list(waiting)
  target = (finish_target(len(todo), pause.finish_fraction)
            if pause is not None and pause.finish_fraction else None)
  budget = pause.token_budget if pause is not None and pause.token_budget else None
  paused = lambda generated, finished: ((budget is not None and generated >= budget) or
                                        (target is not None and finished >= target))
  abort = pause is not None and engine.capabilities.abort
  active: list[Trajectory] = []
  waves = generated = 0
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    while waiting or active:
      while waiting and (max_in_flight is None or len(active) < max_in_flight):
        t = waiting.popleft()
        if limits.allowance(t) < 1:
          t.finish, t.budget_truncated = "length", True  # its prompt fills the row
          if on_over is not None:
            on_over([t])
        else:
          active.append(t)
      if not active:  # those taken from the queue had no room at all: take more
        continue
      if paused(generated, sum(t.over for t in todo)):
        break  # paused at a wave boundary
      wave = _Wave(active, environment, tokenizer, stops, limits, pool, on_over,
                   sum(t.over for t in todo))
      try:
        images = [t.record.get("images") or [] for t in active]
        completions = engine.generate(
            [t.prompt_ids + tuple(t.token_ids) for t in active], call,
            **({"images": images} if any(images) else {}),
            seed=seed + waves * 7919, affinity=[t.affinity for t in active],
            max_new_tokens=wave.allowances, on_ready=wave.hand_over,
            stop_when=(lambda *_: paused(generated + wave.generated, wave.finished))
            if abort else None)
      finally:
        wave.answering.shutdown(wait=True)
      wave.close(len(completions))
      generated += wave.generated
      waves += 1
      active = [t for t in active if not t.over]
  unfinished = sum(not t.over for t in todo)
  return {"waves": waves, "generated_tokens": generated, "finished": len(todo) - unfinished,
          "unfinished": unfinished, "paused": bool(unfinished)}


def run_episodes(engine: RolloutEngine, environment: Environment, tokenizer,
                 records: Sequence[dict], prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams, *, seed: int,
                 max_sequence_tokens: int | None = None, max_in_flight: int | None = None,
                 workers: int = 4) -> list[Episode]:
  """One finished Episode per (record, prompt), in order (see the module docstring)."""
  trajectories = start(environment, records, prompts)
  advance(engine, environment, tokenizer, trajectories, sampling, seed=seed,
          max_sequence_tokens=max_sequence_tokens, max_in_flight=max_in_flight,
          workers=workers)
  return [t.episode() for t in trajectories]
