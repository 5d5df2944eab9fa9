"""Evaluation of a policy on a task's records.

Owns generate-then-verify over a list of records (shared with the loop's rollouts) and
held-out greedy accuracy. A completion counts as correct only if it finished on a stop
token and the task's verifier accepts it: a truncated answer never scores.
"""

import dataclasses
from typing import Any, Sequence

import numpy as np

from rollouts.engine import Completion, RolloutEngine, SamplingParams


@dataclasses.dataclass
class Scored:
  """Completions for a list of prompts, `samples` per prompt, flattened prompt-major."""
  prompt_ids: list[list[int]]
  completions: list[Completion]
  texts: list[str]
  correct: np.ndarray  # bool[n]
  lengths: np.ndarray  # i32[n]
  truncated: np.ndarray  # bool[n]
  well_formed: np.ndarray  # bool[n]


def prompt_ids(task, tokenizer, record: dict[str, Any]) -> list[int]:
  return tokenizer.encode(task.prompt(record), add_bos=True)


def generate_and_verify(engine: RolloutEngine, task, tokenizer, records: Sequence[dict],
                        sampling: SamplingParams, *, samples: int = 1, seed: int = 0) -> Scored:
  prompts = [prompt_ids(task, tokenizer, r) for r in records]
  requests = [p for p in prompts for _ in range(samples)]
  completions = engine.generate(requests, sampling, seed=seed)
  texts = [tokenizer.decode(c.token_ids) for c in completions]
  truncated = np.array([c.finish_reason != "stop" for c in completions])
  correct = np.array([(not cut) and task.verify(text, records[i // samples])
                      for i, (text, cut) in enumerate(zip(texts, truncated))], bool)
  well_formed = np.array([(not cut) and task.well_formed(text)
                          for text, cut in zip(texts, truncated)], bool)
  lengths = np.array([len(c.token_ids) for c in completions], np.int32)
  return Scored(requests, completions, texts, correct, lengths, truncated, well_formed)


def greedy_accuracy(engine: RolloutEngine, task, tokenizer, *, num_records: int,
                    max_new_tokens: int, split: str = "test", batch_size: int = 512):
  """(accuracy, mean completion length) over the first `num_records` of `split`, greedy."""
  source = getattr(task, split)
  if num_records > len(source):
    raise ValueError(f"greedy_accuracy: {num_records} records asked, the {split} split has "
                     f"{len(source)}")
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(tokenizer.eos_id,))
  correct, lengths = [], []
  for start in range(0, num_records, batch_size):
    records = [source[i] for i in range(start, min(start + batch_size, num_records))]
    scored = generate_and_verify(engine, task, tokenizer, records, sampling)
    correct.append(scored.correct)
    lengths.append(scored.lengths)
  return float(np.concatenate(correct).mean()), float(np.concatenate(lengths).mean())
