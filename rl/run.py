"""A built run's handle: its parts and loop state, what its hooks read and write (metrics,
sample generations, the summary, evaluations) and one cleanup stack that releases what the
build acquired. rl/trainer.py builds it, rl/hooks.py drives it, a notebook holds it and calls
`steps()` itself."""

import contextlib
import dataclasses
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from models import distributed
from models.config import ModelConfig
from rl import eval as eval_lib
from rl import loggers as loggers_lib
from rl import loop
from rl import metrics as metrics_lib
from rl import samples as samples_lib
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rollouts.engine import RolloutEngine


@dataclasses.dataclass
class Run:
  """A built run: its parts and state, and what its hooks read and write. `steps()` is the
  loop's generator from the current state; `close()` unwinds `cleanup`."""
  run_dir: str
  cfg: ModelConfig
  task: Any
  tokenizer: Any
  config: RLConfig
  parts: loop.Parts
  state: loop.LoopState
  checkpointer: Checkpointer
  loggers: loggers_lib.Loggers
  summary: dict[str, Any]
  resumed: bool
  evaluation_records: int  # the held-out records an evaluation reads (Evaluation.records)
  evaluation_engine: Optional[RolloutEngine] = None
  hooks: list[Any] = dataclasses.field(default_factory=list)
  # What the build acquired, released in reverse: the run directory (rl/run_lock.py) first
  # in, so last out, then the teachers, the rollout engine, the checkpointer and the loggers,
  # the evaluation's own engine.
  cleanup: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
  stopped: Optional[dict[str, Any]] = None
  label: str = ""
  samples: int = 0  # how many of an evaluation's or a step's trajectories write_samples keeps

  @property
  def primary(self) -> bool:
    return distributed.is_primary()

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.run_dir, "metrics.jsonl")

  def say(self, *args, **kwargs) -> None:
    """Print, on process 0 only (it alone writes and talks)."""
    if self.primary:
      print(*args, **kwargs)

  def write(self, metrics: dict[str, Any], histograms: Optional[dict] = None) -> None:
    """One record: into metrics.jsonl (process 0) and to the loggers."""
    if self.primary:
      metrics_lib.append(self.metrics_path, metrics)
    self.loggers.log(metrics, histograms)

  def write_summary(self) -> None:
    if self.primary:
      with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
        json.dump(self.summary, f, indent=2)

  def write_samples(self, step: int, split: str, trajectories: Sequence[Any],
                    rewards: Optional[np.ndarray] = None,
                    advantages: Optional[np.ndarray] = None) -> None:
    """`samples` of `trajectories` (rl.samples.pick), with a training step's rewards and
    advantages (f32[len(trajectories)] each), into samples.jsonl and the loggers' tables
    (`samples/<split>`); process 0 alone, which has every process's trajectories."""
    if not (self.primary and self.samples):
      return
    step = int(step)  # a notebook may pass the train state's step, an array
    chosen = samples_lib.pick(self.samples, len(trajectories))
    take = lambda array: None if array is None else np.asarray(array)[chosen]
    rows = samples_lib.rows(step, split, [trajectories[i] for i in chosen], self.tokenizer,
                            self.task, rewards=take(rewards), advantages=take(advantages))
    samples_lib.append(os.path.join(self.run_dir, samples_lib.FILE), rows)
    self.loggers.table(step, f"samples/{split}", samples_lib.COLUMNS, samples_lib.cells(rows))

  def evaluate(self, step: int, split: str = "eval") -> dict[str, float]:
    """Held-out greedy evaluation of the current params: rl.eval.greedy_eval's metrics; its
    samples go to write_samples as `split`."""
    trajectories = eval_lib.greedy_trajectories(
        self._evaluation_engine(step), self.task, self.tokenizer,
        num_records=self.evaluation_records, max_new_tokens=self.config.max_new_tokens)
    self.write_samples(step, split, trajectories)
    return eval_lib.held_out_metrics(self.task, trajectories)

  def sampled_eval(self, step: int, spec: eval_lib.SampledEval, seed: int) -> dict:
    """rl.eval.sampled_eval of the current params on the evaluation's records, computed on
    process 0 (where servers are driven) and shared with every process."""
    engine = self._evaluation_engine(step)
    records = [self.task.test[i] for i in range(self.evaluation_records)]
    report = distributed.checked(lambda: eval_lib.sampled_eval(
        engine, self.task, self.tokenizer, records, spec, seed=seed) if self.primary else None)
    return distributed.gather(report)[0]

  def _evaluation_engine(self, step: int) -> Optional[RolloutEngine]:
    engine = self.evaluation_engine
    if engine is not self.parts.context.engine and engine is not None:
      engine.update_weights(distributed.local_copy(
          loop.plain_policy(self.parts, self.state.train.params)), step)
    return engine

  def steps(self):
    """The loop's generator from the current state (rl.loop.rl_steps); `state` follows it."""
    inner = loop.rl_steps(self.state, self.parts)
    try:
      for record in inner:
        self.state = record.state
        yield record
    finally:
      inner.close()  # a source running ahead stops

  def close(self) -> None:
    """Release everything the build acquired; a second call does nothing."""
    self.cleanup.close()
