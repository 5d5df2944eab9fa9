"""The environment protocol of episodes, the one-turn environment, and the registry.

An episode is a prompt followed by turns (a single-turn task's: one turn, OneTurn). The policy generates a turn: its tokens end at a stop
token, at one of the environment's stop strings, or at a token budget. The environment answers
with observation tokens (tool output, environment text), a per-turn reward or None, and whether
the episode is done or truncated. The continuation after the prompt is one trajectory
(rl/trajectory.py), and once over one `Episode`, a rollouts.engine.Completion: policy and
observation tokens concatenated in the order the model saw them, `policy_mask` telling them
apart. Observation tokens carry log-prob 0 and stay out of
the loss; everything that counts lengths counts the policy's tokens.

Owns Turn, Observation, the Environment protocol, OneTurn and `environment_of`, the registry
of environments and `episode_metrics`. rl/envs/driver.py runs episodes over a RolloutEngine; tools.py and formats.py are the tools and their call syntax;
tool_env.py is the environment that runs them. It does not own verification (the task's
`verify` scores the episode's text) or training.

Adding an environment: a class (or factory) with `stop_strings`, `max_turn_tokens`,
`max_turns`, `reset(record) -> state`, `step(state, turn, tokenizer) -> (state, Observation)` and `close()`,
decorated with `@register_environment(name)`; experiments/gin_externals.py makes every
registered one a gin configurable.
"""

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from models.tokenizer import CharTokenizer, ChatPrompts
from rl import ConfigError
from rl.trajectory import Episode
from rollouts.engine import Completion


@dataclasses.dataclass(frozen=True)
class Turn:
  """What the policy said in one turn.

  index: the turn's number in its episode, from 0.
  token_ids: i32[n] the turn's tokens (a stop token included).
  text: their decoding.
  finish_reason: "stop" (a stop token or stop string ended it) or "length" (a token budget did).
  """
  index: int
  token_ids: np.ndarray
  text: str
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class Observation:
  """The environment's answer to a turn.

  token_ids: observation tokens appended to the sequence (in the context, out of the loss).
  reward: this turn's reward, or None (the episode's outcome is the task's verdict).
  done: the episode is over; truncated: it was ended by a limit, not by the policy (it then
    never counts as correct).
  counts: counters this turn adds to the episode (e.g. tool_calls), logged per step.
  """
  token_ids: Sequence[int] = ()
  reward: float | None = None
  done: bool = False
  truncated: bool = False
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  """stop_strings end a turn besides the stop tokens (e.g. a tool call's closing tag);
  max_turn_tokens is the policy's budget per turn (None: only the episode's budget);
  max_turns the most policy turns an episode has (None: no bound; 1: single-turn), so that
  the end of its last turn ends the episode whatever `step` answers."""

  stop_strings: tuple[str, ...]
  max_turn_tokens: int | None
  max_turns: int | None

  def reset(self, record: dict[str, Any]) -> Any:
    """The initial state of an episode on `record` (None for a stateless environment)."""
    ...

  def step(self, state: Any, turn: Turn, tokenizer) -> tuple[Any, "Observation"]:
    """Answer `turn`; returns the new state and the observation. Called from worker threads,
    several episodes at once: whatever the environment shares between episodes (a sandbox
    pool) must be thread-safe."""
    ...

  def close(self) -> None:
    """Release what the environment holds (sandboxes)."""
    ...


class OneTurn:
  """The environment of a single-turn task: the policy's one turn is the episode, ended by a
  stop token or the token budget; nothing is observed. Every task without an `environment`
  of its own runs in it (`environment_of`)."""

  stop_strings: tuple[str, ...] = ()
  max_turn_tokens: int | None = None
  max_turns: int | None = 1

  def reset(self, record: dict[str, Any]) -> None:
    del record
    return None

  def step(self, state, turn: Turn, tokenizer) -> tuple[None, "Observation"]:
    del tokenizer
    return state, Observation(done=True, truncated=turn.finish_reason != "stop")

  def close(self) -> None:
    pass


ONE_TURN = OneTurn()


def environment_of(task) -> Environment:
  """The environment `task`'s rollouts run in: its own (an agentic task's `environment`), or
  OneTurn."""
  environment = getattr(task, "environment", None)
  return ONE_TURN if environment is None else environment


def multi_turn(environment: Environment) -> bool:
  """Whether episodes of `environment` can have more than one turn (and so episode metrics,
  observation tokens and per-turn rewards)."""
  return environment.max_turns != 1


def policy_tokens(completion: Completion) -> int:
  """How many of a completion's tokens the policy generated."""
  if completion.policy_mask is None:
    return len(completion.token_ids)
  return int(np.count_nonzero(completion.policy_mask))


def episode_metrics(completions: Sequence[Completion]) -> dict[str, float]:
  """Per-step means over the episodes among `completions` ({} when there are none):
  episode_turns, episode_policy_tokens, episode_observation_tokens, episode_budget_truncated
  (a fraction), and for each counter of the environment episode_<counter> (its mean) and
  episode_<counter>_rate (the fraction of episodes where it is not 0): for ToolEnvironment
  episode_tool_calls, episode_tool_calls_rate (how many episodes call a tool),
  episode_tool_errors, episode_tool_timeouts and their rates."""
  episodes = [c for c in completions if isinstance(c, Episode)]
  if not episodes:
    return {}
  policy = np.array([policy_tokens(e) for e in episodes], np.float64)
  total = np.array([len(e.token_ids) for e in episodes], np.float64)
  metrics = {"episode_turns": float(np.mean([e.turns for e in episodes])),
             "episode_policy_tokens": float(policy.mean()),
             "episode_observation_tokens": float((total - policy).mean()),
             "episode_budget_truncated": float(np.mean([e.budget_truncated for e in episodes]))}
  for key in sorted({k for e in episodes for k in e.counts}):
    counts = np.array([e.counts.get(key, 0) for e in episodes], np.float64)
    metrics[f"episode_{key}"] = float(counts.mean())
    metrics[f"episode_{key}_rate"] = float(np.mean(counts != 0))
  return metrics


def encode_text(tokenizer, text: str) -> list[int]:
  """Token ids of environment text as it goes into the sequence: no <bos>, no chat template.
  For a CharTokenizer, characters outside its alphabet (tool output can hold any) become
  their lower case where that is in it, whitespace a space, anything else '?'."""
  if isinstance(tokenizer, CharTokenizer):
    alphabet = set(tokenizer.alphabet)
    text = "".join(c if c in alphabet else c.lower() if c.lower() in alphabet
                   else " " if c.isspace() and " " in alphabet else "?" for c in text)
    return tokenizer.encode(text)
  if isinstance(tokenizer, ChatPrompts):
    return tokenizer.tokenizer.encode(text)
  return tokenizer.encode(text)


# ----------------------------------------------------------------------------- registry

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str):
  """Decorator: register an environment class or factory under `name`."""

  def add(factory):
    if name in ENVIRONMENTS:
      raise ValueError(f"environment {name!r} is registered twice")
    ENVIRONMENTS[name] = factory
    return factory
  return add


def make_environment(name: str, **options) -> Environment:
  """The registered environment `name`, built with `options`."""
  if name not in ENVIRONMENTS:
    raise ConfigError(f"unknown environment {name!r}; registered environments: "
                      f"{', '.join(sorted(ENVIRONMENTS))}")
  return ENVIRONMENTS[name](**options)
