"""The multi-turn rollout driver: episodes of an Environment over any RolloutEngine.

Token-in/token-out. Every request is the prompt plus every token of the episode so far,
exactly as the engine generated them or the environment answered them; nothing is
re-tokenised, so the trajectory is what the policy saw and the trainer's log-probs of it are
the engine's.

Waves. All active episodes advance together: each wave generates the next stretch of every
active episode (one engine.generate call per token-allowance bucket, see below), then the
environment answers the turns that ended (on `workers` threads, several episodes at once), and
the next wave starts. An episode that is over frees its slot, and a waiting one (beyond
`max_in_flight`) takes it at the next wave. What this promises: the turns of different
episodes are batched together; no episode waits for another's later turns or tool calls, only
for the wave it is in. What it does not: within a wave the engine call returns when its
longest member is done (RolloutEngine.generate is synchronous), so a short turn waits for the
longest one of its wave; episodes each with a request stream of their own, as verl's agent
loop runs them over asynchronous servers, would need an asynchronous engine API.

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
policy and observation tokens (what a packed training row holds). Each wave gives an episode
the tokens it has left: the engine call's max_new is that rounded up to a power of two when
it is less than a full turn (so that the embedded engine compiles a few shapes and episodes
with similar allowances share a call), and what an episode generated past its allowance is
dropped before anything sees it (rounding down instead would split a turn over two waves).
An episode out of either episode budget ends truncated ("length", budget_truncated), its last
observation cut to the room left.

SGLang servers: every request of an episode carries the same affinity key (its prompt's
hash, as single-turn requests and partial rollouts use), so each continuation goes to the
server that already holds its prefix in cache.

Partial rollouts. `advance(..., token_budget=B)` returns once the tokens generated since it was
called reach B, `advance(..., finish_fraction=L)` once ceil(L * n) of its n episodes are over
(checked between waves: an iteration boundary; no request is aborted, so any engine pauses).
The unfinished episodes keep their explicit state (tokens, log-probs, per-token versions, the
environment's state) and resume where they stopped at the next call, after a weight update too;
`EpisodeState.episode()` of an unfinished one has finish_reason "abort".
"""

import collections
import concurrent.futures
import dataclasses
from typing import Any, Sequence

import numpy as np

from rl.envs.base import Environment, Episode, Observation, Turn, encode_text
from rollouts import partial
from rollouts.engine import Completion, RolloutEngine, SamplingParams


@dataclasses.dataclass
class EpisodeState:
  """One episode in progress: the driver's explicit, mutable state of it."""
  record: dict
  prompt_ids: tuple[int, ...]
  env_state: Any
  affinity: int
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  policy_mask: list[bool] = dataclasses.field(default_factory=list)
  policy_count: int = 0
  turn_start: int = 0  # where the current turn's tokens begin in token_ids
  turn_ends: list[int] = dataclasses.field(default_factory=list)
  turn_rewards: list[float | None] = dataclasses.field(default_factory=list)
  counts: dict[str, int] = dataclasses.field(default_factory=dict)
  finish: str | None = None  # "stop" or "length" once over
  budget_truncated: bool = False

  @property
  def over(self) -> bool:
    return self.finish is not None

  def episode(self) -> Episode:
    return Episode(np.array(self.token_ids, np.int32), np.array(self.logprobs, np.float32),
                   self.finish or "abort", np.array(self.versions, np.int32),
                   policy_mask=np.array(self.policy_mask, bool),
                   turn_ends=tuple(self.turn_ends), turn_rewards=tuple(self.turn_rewards),
                   counts=dict(self.counts), budget_truncated=self.budget_truncated)


def start(environment: Environment, records: Sequence[dict],
          prompts: Sequence[Sequence[int]]) -> list[EpisodeState]:
  """A fresh episode per (record, prompt)."""
  if len(records) != len(prompts):
    raise ValueError(f"start: {len(records)} records for {len(prompts)} prompts")
  return [EpisodeState(record, tuple(int(t) for t in prompt), environment.reset(record),
                       affinity(prompt))
          for record, prompt in zip(records, prompts)]


def affinity(prompt: Sequence[int]) -> int:
  """The affinity key of every request of an episode on `prompt` (its prefix's server)."""
  return hash(tuple(int(t) for t in prompt)) & 0x7FFFFFFF


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


def _room(e: EpisodeState, sampling: SamplingParams, max_sequence_tokens: int | None) -> int:
  """Tokens the episode may still generate under its episode budgets."""
  room = sampling.max_new_tokens - e.policy_count
  if max_sequence_tokens is not None:
    room = min(room, max_sequence_tokens - len(e.prompt_ids) - len(e.token_ids))
  return room


def _allowance(e: EpisodeState, environment: Environment, sampling: SamplingParams,
               max_sequence_tokens: int | None) -> int:
  """Tokens the episode may generate now: its episode room and its turn's."""
  room = _room(e, sampling, max_sequence_tokens)
  if environment.max_turn_tokens is not None:
    room = min(room, environment.max_turn_tokens - (len(e.token_ids) - e.turn_start))
  return room


def _wave_tokens(allowance: int, full_turn: int) -> int:
  """The engine call's max_new for an episode allowed `allowance` tokens: the power of two at
  least that large, at most a full turn."""
  return min(full_turn, 1 << (allowance - 1).bit_length())


def _turn_ended(e: EpisodeState, completion: Completion, stops: _Stops, tokenizer,
                allowance_left: int) -> str | None:
  """"stop" or "length" when the current turn is over after `completion`, else None."""
  if completion.finish_reason == "stop" and len(completion.token_ids):
    last = int(completion.token_ids[-1])
    if last in stops.whole:
      return "stop"
    text = tokenizer.decode(e.token_ids[e.turn_start:])
    if any(text.endswith(s) for s in stops.strings):
      return "stop"
  return "length" if allowance_left < 1 else None


def _extend(e: EpisodeState, completion: Completion) -> None:
  n = len(completion.token_ids)
  e.token_ids += [int(t) for t in completion.token_ids]
  e.logprobs += [float(x) for x in completion.logprobs]
  e.versions += [int(v) for v in completion.versions]
  e.policy_mask += [True] * n
  e.policy_count += n


def _answer(e: EpisodeState, state: Any, observation: Observation, sampling: SamplingParams,
            max_sequence_tokens: int | None) -> None:
  """Take the environment's answer to the turn that just ended."""
  e.env_state = state
  e.turn_ends.append(len(e.token_ids))
  e.turn_rewards.append(observation.reward)
  for key, value in observation.counts.items():
    e.counts[key] = e.counts.get(key, 0) + int(value)
  ids = [int(t) for t in observation.token_ids]
  room = len(ids) if max_sequence_tokens is None else max(
      0, max_sequence_tokens - len(e.prompt_ids) - len(e.token_ids))
  cut = len(ids) > room
  ids = ids[:room]
  e.token_ids += ids
  e.logprobs += [0.0] * len(ids)
  e.versions += [e.versions[-1] if e.versions else -1] * len(ids)
  e.policy_mask += [False] * len(ids)
  e.turn_start = len(e.token_ids)
  spent = cut or _room(e, sampling, max_sequence_tokens) < 1
  if observation.done:
    e.finish = "length" if observation.truncated else "stop"
  elif spent:
    e.finish = "length"
  e.budget_truncated = e.finish == "length" and spent


def advance(engine: RolloutEngine, environment: Environment, tokenizer,
            episodes: Sequence[EpisodeState], sampling: SamplingParams, *, seed: int,
            max_sequence_tokens: int | None = None, max_in_flight: int | None = None,
            token_budget: int | None = None, finish_fraction: float | None = None,
            workers: int = 4) -> dict[str, Any]:
  """Run the unfinished `episodes` (in place) in waves until every one is over, or pause (call
  again to resume): with `token_budget` once the tokens generated by this call reach it
  (k1.5), with `finish_fraction` once ceil(finish_fraction * n) of the n episodes unfinished
  at the call are over (K3's lambda). Returns {"waves", "generated_tokens", "finished",
  "paused"}."""
  stops = _stops(environment, tokenizer, sampling)
  full_turn = min(sampling.max_new_tokens, environment.max_turn_tokens or sampling.max_new_tokens)
  waiting = collections.deque(e for e in episodes if not e.over)
  target = None if finish_fraction is None else partial.finish_target(len(waiting),
                                                                      finish_fraction)
  todo = list(waiting)
  active: list[EpisodeState] = []
  waves = generated = 0
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    while waiting or active:
      while waiting and (max_in_flight is None or len(active) < max_in_flight):
        e = waiting.popleft()
        if _allowance(e, environment, sampling, max_sequence_tokens) < 1:
          e.finish, e.budget_truncated = "length", True  # its prompt fills the row
        else:
          active.append(e)
      if not active:  # those taken from the queue had no room at all: take more
        continue
      if (token_budget is not None and generated >= token_budget) or (
          target is not None and sum(e.over for e in todo) >= target):
        break  # paused at a wave boundary
      buckets: dict[int, list[EpisodeState]] = {}
      for e in active:
        allowance = _allowance(e, environment, sampling, max_sequence_tokens)
        buckets.setdefault(_wave_tokens(allowance, full_turn), []).append(e)
      ended: list[tuple[EpisodeState, str]] = []
      for b, (max_new, members) in enumerate(sorted(buckets.items())):
        completions = engine.generate(
            [e.prompt_ids + tuple(e.token_ids) for e in members],
            dataclasses.replace(sampling, max_new_tokens=max_new,
                                stop_token_ids=tuple(sorted(stops.whole | stops.last))),
            seed=(seed * 1_000_003 + waves * 7919 + b) % 2**31,
            affinity=[e.affinity for e in members])
        for e, completion in zip(members, completions):
          allowance = _allowance(e, environment, sampling, max_sequence_tokens)
          if len(completion.token_ids) > allowance:  # the call's max_new was rounded up
            completion = Completion(completion.token_ids[:allowance],
                                    completion.logprobs[:allowance], "length",
                                    completion.versions[:allowance])
          generated += len(completion.token_ids)
          _extend(e, completion)
          reason = _turn_ended(e, completion, stops, tokenizer,
                               _allowance(e, environment, sampling, max_sequence_tokens))
          if reason is not None:
            ended.append((e, reason))
      waves += 1
      turns = [(e, Turn(len(e.turn_ends), np.array(e.token_ids[e.turn_start:], np.int32),
                        tokenizer.decode(e.token_ids[e.turn_start:]), reason))
               for e, reason in ended]
      answers = pool.map(lambda et: environment.step(et[0].env_state, et[1], tokenizer), turns)
      for (e, _), (state, observation) in zip(turns, answers):
        _answer(e, state, observation, sampling, max_sequence_tokens)
      active = [e for e in active if not e.over]
  return {"waves": waves, "generated_tokens": generated,
          "finished": sum(e.over for e in todo), "paused": bool(waiting or active)}


def run_episodes(engine: RolloutEngine, environment: Environment, tokenizer,
                 records: Sequence[dict], prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams, *, seed: int,
                 max_sequence_tokens: int | None = None, max_in_flight: int | None = None,
                 workers: int = 4) -> list[Episode]:
  """One finished Episode per (record, prompt), in order (see the module docstring)."""
  episodes = start(environment, records, prompts)
  advance(engine, environment, tokenizer, episodes, sampling, seed=seed,
          max_sequence_tokens=max_sequence_tokens, max_in_flight=max_in_flight,
          workers=workers)
  return [e.episode() for e in episodes]
