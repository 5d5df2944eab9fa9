"""Reasoning effort (low / high / max) as a budget condition the policy is trained to obey.

Owns the effort field of prompts (`EffortTask`, a wrapper around any Task), the per-record
level ids the budget transform reads (`level_ids`), budgets estimated from the model's own
lengths at the start of training (`estimate_budgets`, Kimi K3's recipe) and the sampled
evaluation's budget sweep run once per level (`sampled_eval_by_level`; its plot, one curve
per level, is experiments/evaluation.py's). The reward rule itself, over budget -> a fixed reward, and its
tightening schedule are rl.rewards.effort_budget and rl.rewards.tightening.

Record layout: `EffortTask(inner).train[i]` is problem `i // L` of `inner.train` at level
`i % L` (L levels), so every problem is trained at every level and a record index names a
(problem, level) pair, the key of its budget. A record is the inner record plus "effort"
(the level's name), "effort_level" (its index) and "problem" (the inner index). The verifier
is the inner task's, unchanged (its `verify_batch` too, when it has one): effort changes what
is rewarded, not what is correct. Multi-turn (agentic) tasks are not wrapped yet.
"""

import dataclasses
from typing import Any, Sequence

import numpy as np

from models.tokenizer import stop_ids
from rl import ConfigError
from rl import eval as eval_lib
from rl import rewards
from rl import rollout
from rl.trajectory import column
from rollouts.engine import RolloutEngine, SamplingParams


@dataclasses.dataclass(frozen=True)
class EffortSource:
  """grain random-access source: record i = `source[i // L]` at level `i % L`."""
  source: Any
  levels: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.source) * len(self.levels)

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < len(self):
      raise IndexError(f"EffortSource index {index} out of range [0, {len(self)})")
    problem, level = divmod(index, len(self.levels))
    return {**self.source[problem], "effort": self.levels[level], "effort_level": level,
            "problem": problem}


@dataclasses.dataclass(frozen=True)
class EffortTask:
  """`inner` (any Task) with an effort level named in every prompt: `template` (formatted
  with `level`) comes before the inner prompt. The default suits CharTokenizer tasks
  ("effort:low 47+85="); with a chat template, e.g. "Reasoning effort: {level}.\\n\\n" starts
  the user message."""
  inner: Any
  levels: tuple[str, ...] = ("low", "high", "max")
  template: str = "effort:{level} "

  def __post_init__(self):
    if not self.levels or len(set(self.levels)) != len(self.levels):
      raise ConfigError(f"EffortTask.levels must be distinct names, got {self.levels}")
    if "{level}" not in self.template:
      raise ConfigError(f"EffortTask.template must contain {{level}}, got {self.template!r}")
    if getattr(self.inner, "environment", None) is not None:
      raise ConfigError(f"EffortTask wraps single-turn tasks; {type(self.inner).__name__} runs "
                       "multi-turn episodes (an environment)")

  def __getattr__(self, name):
    # The inner task's batched verifier, when it has one (Task's optional verify_batch).
    if name == "verify_batch":
      return self.inner.verify_batch
    raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

  @property
  def train(self) -> EffortSource:
    return EffortSource(self.inner.train, tuple(self.levels))

  @property
  def test(self) -> EffortSource:
    return EffortSource(self.inner.test, tuple(self.levels))

  def prompt(self, record: dict[str, Any]) -> str:
    return self.template.format(level=record["effort"]) + self.inner.prompt(record)

  def solution(self, record: dict[str, Any]) -> str:
    return self.inner.solution(record)

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self.inner.verify(completion, record)

  def well_formed(self, completion: str) -> bool:
    return self.inner.well_formed(completion)

  def answer(self, completion: str) -> str | None:
    return self.inner.answer(completion)


def level_ids(task: EffortTask, split: str = "train") -> np.ndarray:
  """The level index of every record of `split`: i32[len(split)] (rewards.effort_budget's
  `levels`)."""
  return (np.arange(len(getattr(task, split))) % len(task.levels)).astype(np.int32)


def estimate_budgets(engine: RolloutEngine, task: EffortTask, tokenizer, *, samples: int,
                     max_new_tokens: int, multipliers: Sequence[float] = (0.5, 1.0, 2.0),
                     quantile: float = 0.5, records: Sequence[int] | None = None,
                     temperature: float = 1.0, batch_size: int = 64,
                     seed: int = 0) -> np.ndarray:
  """K3's budgets, from the model's own lengths at the start: for each record (a problem at
  a level) `samples` completions, budget = rewards.budget_from_lengths(their lengths, the
  level's multiplier). f32[len(task.train)], NaN for records not in `records` (default all;
  rewards.effort_budget estimates those from their first group)."""
  records = range(len(task.train)) if records is None else records
  levels = level_ids(task)
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=stop_ids(tokenizer))
  budgets = np.full(len(task.train), np.nan, np.float32)
  records = [int(i) for i in records]
  for start in range(0, len(records), batch_size):
    chunk = records[start:start + batch_size]
    trajectories = rollout.generate(engine, task, tokenizer, [task.train[i] for i in chunk],
                                    sampling, samples=samples, seed=seed + start)
    lengths = column(trajectories, "policy_count", np.int32)
    multiplier = np.asarray(multipliers, np.float32)[levels[chunk]]
    budgets[chunk] = np.asarray(rewards.budget_from_lengths(
        lengths.reshape(len(chunk), samples), multiplier, quantile=quantile))
  return budgets


def sampled_eval_by_level(engine: RolloutEngine, task: EffortTask, tokenizer,
                          spec: eval_lib.SampledEval, *, num_problems: int,
                          split: str = "test", seed: int = 0) -> dict[str, dict]:
  """{level: eval.sampled_eval's report} on the first `num_problems` problems of `split`,
  the same problems at every level: accuracy vs token budget for each level of one model."""
  source = getattr(task, split)
  if num_problems > len(source.source):
    raise ValueError(f"sampled_eval_by_level: {num_problems} problems asked, the {split} "
                     f"split has {len(source.source)}")
  count = len(task.levels)
  return {level: eval_lib.sampled_eval(engine, task, tokenizer,
                                       [source[p * count + index] for p in range(num_problems)],
                                       spec, seed=seed)
          for index, level in enumerate(task.levels)}


def mean_length(report: dict) -> float:
  """Mean completion length of a sampled_eval report (at its largest budget)."""
  lengths = report["lengths"]["correct"] + report["lengths"]["incorrect"]
  return float(np.mean(lengths)) if lengths else 0.0
