"""A run's sample generations: RUN_DIR/samples.jsonl, one JSON object per sample.

A few trajectories of every evaluation and of every `Hooks.samples_every`-th training step,
with their prompts and completions as text, rewards and verdicts: what a researcher reads
before any number. Owns which trajectories are shown (`pick`), their rows and the file;
the hooks decide when (rl/hooks.py, rl/run.py `Run.write_samples`), the loggers show the
same rows as a table (rl/loggers.py). A resumed run moves the rows of the steps it redoes out
of the file as it does metrics.jsonl's (rl.metrics.truncate).
"""

import json
from typing import Any, Optional, Sequence

import numpy as np

from rl.trajectory import Trajectory

FILE = "samples.jsonl"

# A row's fields shown in the loggers' tables; its step and split are the table's step and tag.
COLUMNS = ("prompt", "completion", "reward", "advantage", "correct", "answer", "expected",
           "well_formed", "length", "finish")


def pick(count: int, n: int) -> list[int]:
  """min(count, n) indices into n trajectories, spread evenly from the first to the last: a
  step's trajectories are group-major, so these cover its prompts rather than one prompt's
  samples."""
  k = min(count, n)
  return [i * (n - 1) // max(k - 1, 1) for i in range(k)]


def rows(step: int, split: str, trajectories: Sequence[Trajectory], tokenizer, task, *,
         rewards: Optional[np.ndarray] = None, advantages: Optional[np.ndarray] = None
         ) -> list[dict[str, Any]]:
  """One row per verified trajectory: {"step", "split", "prompt" (its prompt ids decoded:
  what the policy saw, chat template included), "completion" (its text: an episode's
  observations included), "reward" and "advantage" (f32[len(trajectories)] each, a
  training step's; None for an evaluation's), "correct", "answer" (the answer the task
  extracts from the completion, or None), "expected" (the record's "answer", or None),
  "well_formed", "length" (the policy's tokens), "finish" ("stop" or "length")}."""
  def value(array, i):
    return None if array is None else float(array[i])

  return [{"step": step, "split": split, "prompt": tokenizer.decode(t.prompt_ids),
           "completion": t.text, "reward": value(rewards, i), "advantage": value(advantages, i),
           "correct": t.correct, "answer": task.answer(t.text),
           "expected": None if t.record.get("answer") is None else str(t.record["answer"]),
           "well_formed": t.well_formed, "length": t.policy_count, "finish": t.finish}
          for i, t in enumerate(trajectories)]


def cells(sample_rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
  """The rows as a table's cells, one list per row in COLUMNS' order."""
  return [[row[column] for column in COLUMNS] for row in sample_rows]


def append(path: str, sample_rows: Sequence[dict[str, Any]]) -> None:
  with open(path, "a") as f:
    f.writelines(json.dumps(row) + "\n" for row in sample_rows)
