"""Evaluation of a policy on a task's records, and its metrics.

Owns held-out greedy evaluation and the sampled evaluation's pass@k, maj@k and mean@k at
several token budgets. A completion counts as correct only if it finished on a stop token and
the task's verifier accepts it: a truncated answer never scores (rl/rollout.py generates and
verifies). For an agentic task the completions are multi-turn episodes (rl/envs), verified on
the episode's whole text; their lengths, and so the token budgets of `sampled_eval`, count
the policy's tokens. Reports on disk and their plots, and evaluating a saved checkpoint, are
experiments/evaluation.py's.
"""

import dataclasses
from typing import Any, Sequence

import numpy as np

from models import distributed
from models.tokenizer import stop_ids
from rl import rollout
from rl import tasks
from rl.envs.base import environment_of, episode_metrics, multi_turn
from rl.trajectory import Trajectory, column
from rollouts.engine import RolloutEngine, SamplingParams


def _share(engine: RolloutEngine | None, source, indices) -> list[dict]:
  """The records of `indices` this process evaluates: its share when every process has an
  engine, all of them on process 0 when one engine serves every process."""
  if engine is not None and not engine.capabilities.serves_all_processes:
    return tasks.process_share(source, indices)
  return [source[int(i)] for i in indices] if distributed.is_primary() else []


def greedy_eval(engine: RolloutEngine | None, task, tokenizer, *, num_records: int,
                max_new_tokens: int, split: str = "test", batch_size: int = 512
                ) -> dict[str, float]:
  """Greedy decoding over the first `num_records` of `split`: held_out_metrics of
  greedy_trajectories (see both)."""
  return held_out_metrics(task, greedy_trajectories(
      engine, task, tokenizer, num_records=num_records, max_new_tokens=max_new_tokens,
      split=split, batch_size=batch_size))


def greedy_trajectories(engine: RolloutEngine | None, task, tokenizer, *, num_records: int,
                        max_new_tokens: int, split: str = "test", batch_size: int = 512
                        ) -> list[Trajectory]:
  """The verified greedy trajectories of the first `num_records` of `split`, in order.
  With several JAX processes all call it together: each decodes its share of the records
  (rl.tasks.process_share) on an engine of its own, or process 0 all of them on servers (the
  others pass None), and every process gets them all."""
  source = getattr(task, split)
  if num_records > len(source):
    raise ValueError(f"greedy_eval: {num_records} records asked, the {split} split has "
                     f"{len(source)}")
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=stop_ids(tokenizer))
  trajectories = []
  for start in range(0, num_records, batch_size):
    records = _share(engine, source, range(start, min(start + batch_size, num_records)))
    part = distributed.checked(lambda: rollout.generate(engine, task, tokenizer, records,
                                                        sampling) if records else None)
    trajectories += [t for p in distributed.gather(part) if p is not None for t in p]
  return trajectories


def held_out_metrics(task, trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """{"accuracy", "length" (the mean of the policy's tokens)}, for a Mixture each task's
  "accuracy_<domain>", and for an agentic task the episode metrics without their "episode_"
  prefix (rl.envs.episode_metrics: turns, tool_calls, tool_calls_rate, ...)."""
  correct = column(trajectories, "correct", bool)
  metrics = {"accuracy": float(correct.mean()),
             "length": float(column(trajectories, "policy_count", np.int32).mean())}
  domains = [t.record.get("domain") for t in trajectories]
  for domain in dict.fromkeys(d for d in domains if d is not None):  # a Mixture's tasks
    metrics[f"accuracy_{domain}"] = float(correct[[d == domain for d in domains]].mean())
  if multi_turn(environment_of(task)):
    metrics.update({key.removeprefix("episode_"): value for key, value in episode_metrics(
        [t.episode() for t in trajectories]).items()})
  return metrics


# --------------------------------------------------------------------------- sampled evaluation
# pass@k, maj@k and mean@k from n samples per prompt, at several token budgets, plus the
# length distribution of correct and incorrect completions. Generation runs once at the
# largest budget; at a smaller budget B a completion counts only if it finished within B
# tokens (a longer one would have been cut off there, and a truncated answer never scores).


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), as a stable product."""
  if not 1 <= k <= num_samples:
    raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
  if num_samples - num_correct < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1,
                                                   num_samples + 1)))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
  """Majority vote over the first k samples' final answers (None = no answer, no vote).
  Tie rule: among equally frequent answers the one that appeared first wins. The vote is
  correct iff the winning answer's first sample is correct; no answers at all is wrong."""
  votes: dict[str, list[int]] = {}
  for i in range(min(k, len(answers))):
    if answers[i] is not None:
      votes.setdefault(answers[i], []).append(i)
  if not votes:
    return False
  winner = max(votes.values(), key=lambda idx: (len(idx), -idx[0]))
  return bool(correct[winner[0]])


def mean_at_k(correct: Sequence[bool], k: int) -> float:
  """Mean correctness of the first k samples (expected pass@1 from k samples)."""
  return float(np.mean(np.asarray(correct[:k], dtype=np.float64)))


@dataclasses.dataclass(frozen=True)
class SampledEval:
  """What `sampled_eval` measures: `samples` per prompt, metrics for each k in `ks` at each
  token budget in `budgets` (the largest is the generation limit)."""
  samples: int = 8
  ks: tuple[int, ...] = (1, 2, 4, 8)
  budgets: tuple[int, ...] = (64,)
  temperature: float = 1.0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.budgets or min(self.budgets) < 1:
      raise ValueError(f"SampledEval.budgets must be positive token counts, got {self.budgets}")
    if not self.ks or min(self.ks) < 1 or max(self.ks) > self.samples:
      raise ValueError(f"SampledEval.ks must lie in [1, samples={self.samples}], got {self.ks}")


def sampled_eval(engine: RolloutEngine, task, tokenizer, records: Sequence[dict],
                 spec: SampledEval, *, seed: int = 0) -> dict[str, Any]:
  """{"budgets": {B: {"pass@k", "maj@k", "mean@k" for each k, "accuracy"}}, "lengths":
  {"correct", "incorrect"} (tokens, at the largest budget), "samples", "prompts"}."""
  max_budget = max(spec.budgets)
  sampling = SamplingParams(max_new_tokens=max_budget, temperature=spec.temperature,
                            top_p=spec.top_p, stop_token_ids=stop_ids(tokenizer))
  trajectories = rollout.generate(engine, task, tokenizer, records, sampling,
                                  samples=spec.samples, seed=seed)
  n = spec.samples
  answers = [task.answer(t.text) for t in trajectories]
  correct_all = column(trajectories, "correct", bool)
  lengths = column(trajectories, "policy_count", np.int32)
  report: dict[str, Any] = {"samples": n, "prompts": len(records), "budgets": {}}
  for budget in sorted(spec.budgets):
    within = ~column(trajectories, "truncated", bool) & (lengths <= budget)
    correct = (correct_all & within).reshape(len(records), n)
    keys = [a if w else None for a, w in zip(answers, within)]
    metrics = {"accuracy": float(correct.mean())}
    for k in spec.ks:
      metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(row.sum()), k) for row in correct]))
      metrics[f"maj@{k}"] = float(np.mean([maj_at_k(keys[p * n:(p + 1) * n], row, k)
                                           for p, row in enumerate(correct)]))
      metrics[f"mean@{k}"] = float(np.mean([mean_at_k(row, k) for row in correct]))
    report["budgets"][budget] = metrics
  report["lengths"] = {"correct": lengths[correct_all].tolist(),
                       "incorrect": lengths[~correct_all].tolist()}
  return report
