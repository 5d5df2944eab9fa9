"""Evaluation of a policy on a task's records.

Owns generate-then-verify over a list of records (shared with the loop's rollouts) and
held-out greedy evaluation. A completion counts as correct only if it finished on a stop
token and the task's verifier accepts it: a truncated answer never scores. For an agentic
task the completions are multi-turn episodes (rl/envs), verified on the episode's whole text;
their lengths, and so the token budgets of `sampled_eval`, count the policy's tokens.
"""

import dataclasses
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from models import distributed
from rl import envs
from rl import tasks
from rollouts.engine import Completion, RolloutEngine, SamplingParams


@dataclasses.dataclass
class Scored:
  """Completions for a list of prompts, `samples` per prompt, flattened prompt-major."""
  prompt_ids: list[list[int]]
  completions: list[Completion]
  texts: list[str]
  correct: np.ndarray  # bool[n]
  lengths: np.ndarray  # i32[n] the policy's tokens (an episode's observations not counted)
  truncated: np.ndarray  # bool[n]
  well_formed: np.ndarray  # bool[n]
  records: list[dict] = dataclasses.field(default_factory=list)  # each completion's record


def prompt_ids(task, tokenizer, record: dict[str, Any]) -> list[int]:
  return tokenizer.encode(task.prompt(record), add_bos=True)


def generate_and_verify(engine: RolloutEngine, task, tokenizer, records: Sequence[dict],
                        sampling: SamplingParams, *, samples: int = 1, seed: int = 0,
                        max_sequence_tokens: int | None = None,
                        timings: dict[str, float] | None = None) -> Scored:
  """`samples` completions per record, verified. Each completion is verified as soon as the
  engine hands it over (RolloutEngine.generate's `on_ready`), on a thread of its own (so in the task's worker
  pool: MathVerifier, CodeSandbox, Judge), while the others are still generated: on servers,
  where completions arrive one by one, verification runs concurrently with generation; the
  embedded engine hands over all of them at once.
  A task with an `environment` (agentic: rl/tasks/agentic.py) gets multi-turn episodes
  instead (rl/envs/driver.py), verified once they all ended, with sampling.max_new_tokens
  their budget of policy tokens and `max_sequence_tokens` the most tokens a prompt and its
  episode may hold (the packed row's room; single-turn completions ignore it). `timings`,
  when given, gets added to its "generate_s" (an episode's tool calls count as
  generation), "verify_s" (the wait for verification after generation ended: its share of
  the critical path) and "verify_busy_s" (the verifying thread's whole time)."""
  started = time.perf_counter()
  prompts = [prompt_ids(task, tokenizer, r) for r in records]
  requests = [p for p in prompts for _ in range(samples)]
  repeated = [r for r in records for _ in range(samples)]
  environment = getattr(task, "environment", None)
  verifying = _Verifying(task, tokenizer, repeated, requests)
  try:
    if environment is None:
      completions = engine.generate(requests, sampling, seed=seed,
                                    on_ready=verifying.put)
    else:
      completions = envs.run_episodes(engine, environment, tokenizer, repeated, requests,
                                      sampling, seed=seed,
                                      max_sequence_tokens=max_sequence_tokens)
      verifying.put(dict(enumerate(completions)))
  except BaseException:
    verifying.abandon()
    raise
  generated = time.perf_counter()
  scored = verifying.result(len(completions))
  if timings is not None:
    timings["generate_s"] = timings.get("generate_s", 0.0) + generated - started
    timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - generated
    timings["verify_busy_s"] = timings.get("verify_busy_s", 0.0) + verifying.busy_s
  return scored


class _Verifying:
  """Verifies completions as they are handed over ({index: Completion}), on a thread of its
  own: whatever has arrived since its last check is scored together (one verify_batch), so
  a batched verifier still sees batches."""

  def __init__(self, task, tokenizer, records: Sequence[dict],
               prompts: Sequence[Sequence[int]]):
    self._task, self._tokenizer, self._records, self._prompts = task, tokenizer, records, prompts
    self._arrived: queue.SimpleQueue = queue.SimpleQueue()
    self._parts: list[tuple[list[int], Scored]] = []
    self._error: BaseException | None = None
    self.busy_s = 0.0
    self._thread = threading.Thread(target=self._run, daemon=True, name="verifier")
    self._thread.start()

  def put(self, ready: dict[int, Completion]) -> None:
    self._arrived.put(ready)

  def _run(self) -> None:
    ended = False
    while not ended:
      arrived = [self._arrived.get()]
      while not self._arrived.empty():
        arrived.append(self._arrived.get())
      ended = arrived[-1] is None  # put last, after every completion
      ready = {i: c for a in arrived if a is not None for i, c in a.items()}
      if not ready or self._error is not None:
        continue
      started = time.perf_counter()
      indices = list(ready)
      try:
        self._parts.append((indices, score(
            self._task, self._tokenizer, [self._records[i] for i in indices],
            [self._prompts[i] for i in indices], list(ready.values()))))
      except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by result()
        self._error = e
      self.busy_s += time.perf_counter() - started

  def abandon(self) -> None:
    """Generation failed: the thread ends once done with what it holds."""
    self._arrived.put(None)

  def result(self, count: int) -> Scored:
    """All `count` completions, verified, in index order (waits for the rest)."""
    self._arrived.put(None)
    self._thread.join()
    if self._error is not None:
      raise self._error
    indices = [i for part_indices, _ in self._parts for i in part_indices]
    if sorted(indices) != list(range(count)):
      raise RuntimeError(f"the engine returned {count} completions but handed over "
                         f"{len(indices)} through on_ready (missing: "
                         f"{sorted(set(range(count)) - set(indices))[:8]}); it must hand over "
                         "each once")
    if not self._parts:  # nothing was asked
      return score(self._task, self._tokenizer, [], [], [])
    return take(concat([part for _, part in self._parts]), np.argsort(indices))


def concat(parts: Sequence[Scored], limit: int | None = None) -> Scored:
  """The completions of `parts` in order (the first `limit` of them), as one Scored."""
  lists = lambda name: [x for p in parts for x in getattr(p, name)][:limit]
  arrays = lambda name: np.concatenate([getattr(p, name) for p in parts])[:limit]
  return Scored(lists("prompt_ids"), lists("completions"), lists("texts"), arrays("correct"),
                arrays("lengths"), arrays("truncated"), arrays("well_formed"), lists("records"))


def take(scored: Scored, rows: Sequence[int]) -> Scored:
  """The completions at `rows` (indices into `scored`), in that order."""
  rows = np.asarray(rows, int)
  pick = lambda xs: [xs[i] for i in rows]
  return Scored(pick(scored.prompt_ids), pick(scored.completions), pick(scored.texts),
                scored.correct[rows], scored.lengths[rows], scored.truncated[rows],
                scored.well_formed[rows], pick(scored.records))


def score(task, tokenizer, records: Sequence[dict], prompts: Sequence[Sequence[int]],
          completions: Sequence[Completion]) -> Scored:
  """Verify each completion against its record (one record per completion)."""
  texts = [tokenizer.decode(c.token_ids) for c in completions]
  truncated = np.array([c.finish_reason != "stop" for c in completions], bool)
  finished = np.flatnonzero(~truncated)
  correct = np.zeros(len(completions), bool)
  verify_batch = getattr(task, "verify_batch", None)  # a task that verifies in one batch
  if verify_batch is not None and len(finished):
    correct[finished] = verify_batch([texts[i] for i in finished],
                                     [records[i] for i in finished])
  else:
    correct[finished] = [task.verify(texts[i], records[i]) for i in finished]
  well_formed = np.array([(not cut) and task.well_formed(text)
                          for text, cut in zip(texts, truncated)], bool)
  lengths = np.array([envs.policy_tokens(c) for c in completions], np.int32)
  return Scored([list(p) for p in prompts], list(completions), texts, correct, lengths,
                truncated, well_formed, list(records))


def greedy_eval(engine: RolloutEngine, task, tokenizer, *, num_records: int,
                max_new_tokens: int, split: str = "test", batch_size: int = 512
                ) -> dict[str, float]:
  """Greedy decoding over the first `num_records` of `split`: {"accuracy", "length" (the mean
  of the policy's tokens)}, and for an agentic task the episode metrics without their
  "episode_" prefix (rl.envs.episode_metrics: turns, tool_calls, tool_calls_rate, ...).
  With several JAX processes all call it together, each with an engine of its own: each
  decodes its share of the records (rl.tasks.process_share) and the results are gathered."""
  source = getattr(task, split)
  if num_records > len(source):
    raise ValueError(f"greedy_eval: {num_records} records asked, the {split} split has "
                     f"{len(source)}")
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(tokenizer.eos_id,))
  correct, lengths, completions = [], [], []
  for start in range(0, num_records, batch_size):
    records = tasks.process_share(source, range(start, min(start + batch_size, num_records)))
    part = generate_and_verify(engine, task, tokenizer, records, sampling) if records else None
    scored = concat([p for p in distributed.gather(part) if p is not None])
    correct.append(scored.correct)
    lengths.append(scored.lengths)
    completions += scored.completions
  return {"accuracy": float(np.concatenate(correct).mean()),
          "length": float(np.concatenate(lengths).mean()),
          **{key.removeprefix("episode_"): value
             for key, value in envs.episode_metrics(completions).items()}}


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
                            top_p=spec.top_p, stop_token_ids=(tokenizer.eos_id,))
  scored = generate_and_verify(engine, task, tokenizer, records, sampling,
                               samples=spec.samples, seed=seed)
  n = spec.samples
  answers = [task.answer(text) for text in scored.texts]
  report: dict[str, Any] = {"samples": n, "prompts": len(records), "budgets": {}}
  for budget in sorted(spec.budgets):
    within = ~scored.truncated & (scored.lengths <= budget)
    correct = (scored.correct & within).reshape(len(records), n)
    keys = [a if w else None for a, w in zip(answers, within)]
    metrics = {"accuracy": float(correct.mean())}
    for k in spec.ks:
      metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(row.sum()), k) for row in correct]))
      metrics[f"maj@{k}"] = float(np.mean([maj_at_k(keys[p * n:(p + 1) * n], row, k)
                                           for p, row in enumerate(correct)]))
      metrics[f"mean@{k}"] = float(np.mean([mean_at_k(row, k) for row in correct]))
    report["budgets"][budget] = metrics
  report["lengths"] = {"correct": scored.lengths[scored.correct].tolist(),
                       "incorrect": scored.lengths[~scored.correct].tolist()}
  return report


def write_report(report: dict[str, Any], out_dir: str, *, title: str = "") -> list[str]:
  """report.json plus three plots in `out_dir`: accuracy vs budget, length histograms by
  correctness, pass@k / maj@k / mean@k vs k at the largest budget. Returns the paths."""
  import json
  import os

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, name) for name in
           ("report.json", "accuracy_vs_budget.png", "lengths.png", "pass_at_k.png")]
  with open(paths[0], "w") as f:
    json.dump(report, f, indent=2)
  budgets = sorted(report["budgets"])
  ks = sorted(int(key.split("@")[1]) for key in report["budgets"][budgets[0]]
              if key.startswith("pass@"))

  fig, ax = plt.subplots(figsize=(6, 4))
  for metric in ("mean@1", f"pass@{ks[-1]}", f"maj@{ks[-1]}"):
    ax.plot(budgets, [report["budgets"][b][metric] for b in budgets], marker="o", label=metric)
  save_budget_plot(fig, ax, budgets, title or "accuracy vs budget", paths[1])

  fig, ax = plt.subplots(figsize=(6, 4))
  lengths = report["lengths"]
  bins = np.linspace(0, max(budgets), 30)
  ax.hist([lengths["correct"], lengths["incorrect"]], bins=bins, label=["correct", "incorrect"],
          color=["tab:green", "tab:red"], alpha=0.8)
  ax.set(xlabel="completion tokens", ylabel="completions", title=title or "length by correctness")
  ax.legend()
  fig.tight_layout()
  fig.savefig(paths[2], dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  top = report["budgets"][budgets[-1]]
  for metric in ("pass", "maj", "mean"):
    ax.plot(ks, [top[f"{metric}@{k}"] for k in ks], marker="o", label=f"{metric}@k")
  ax.set(xlabel="k", ylabel="accuracy", ylim=(-0.02, 1.02), xscale="log", title=title or
         f"@k at budget {budgets[-1]}")
  ax.set_xticks(ks, [str(k) for k in ks])
  ax.legend()
  fig.tight_layout()
  fig.savefig(paths[3], dpi=100)
  plt.close(fig)
  return paths


def save_budget_plot(fig, ax, budgets: Sequence[int], title: str, path: str) -> None:
  """Finish an accuracy-vs-token-budget figure (log2 budgets when they span 8x) and save it."""
  import matplotlib.pyplot as plt
  ax.set(xlabel="token budget", ylabel="accuracy", ylim=(-0.02, 1.02), title=title)
  if len(budgets) > 1 and budgets[-1] / budgets[0] >= 8:
    ax.set_xscale("log", base=2)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def evaluate_checkpoint(out_dir: str, *, task, spec: SampledEval = SampledEval(),
                        run_dir: str | None = None, model=None,
                        hf_checkpoint: str | None = None, num_records: int = 64,
                        split: str = "test", seed: int = 0) -> tuple[dict, list[str]]:
  """`sampled_eval` of a checkpoint on the first `num_records` of `split`, written to
  `out_dir` (see `write_report`). Give `run_dir` (a longrl run: its latest RL checkpoint,
  with `model` the same config factory the run used, e.g. models.config.tiny) or
  `hf_checkpoint` (a Hugging Face checkpoint directory). For an rl.effort.EffortTask the
  sweep also runs once per effort level on the first `num_records` problems (report
  "effort", plot accuracy_vs_budget_by_effort.png: one curve per level)."""
  import os

  from models import hf
  from models.tokenizer import CharTokenizer, ChatPrompts, HFTokenizer
  from rl.checkpoint import Checkpointer
  from rollouts.jax_engine import JaxEngine

  if (run_dir is None) == (hf_checkpoint is None):
    raise ValueError("evaluate_checkpoint: give exactly one of run_dir or hf_checkpoint")
  if run_dir is not None:
    if model is None:
      raise ValueError("evaluate_checkpoint: a run_dir needs `model`, the config factory the "
                       "run used (e.g. evaluate.model = @tiny)")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
      raise FileNotFoundError(f"evaluate_checkpoint: {run_dir} has no checkpoints/ directory")
    tokenizer = CharTokenizer()
    cfg = model(tokenizer.vocab_size)
    checkpointer = Checkpointer(checkpoints)
    params = checkpointer.restore_params()
    checkpointer.close()
    name = f"{os.path.basename(os.path.normpath(run_dir))}"
  else:
    cfg, params = hf.load(hf_checkpoint)
    tokenizer = ChatPrompts(HFTokenizer(hf_checkpoint))
    name = os.path.basename(os.path.normpath(hf_checkpoint))
  source = getattr(task, split)
  if num_records > len(source):
    raise ValueError(f"evaluate_checkpoint: {num_records} records asked, the {split} split "
                     f"has {len(source)}")
  records = [source[i] for i in range(num_records)]
  engine = JaxEngine(cfg, params)
  report = sampled_eval(engine, task, tokenizer, records, spec, seed=seed)
  report["checkpoint"] = run_dir or hf_checkpoint
  from rl import effort  # rl.effort imports this module
  if isinstance(task, effort.EffortTask):  # the sweep once per level, the same problems each
    report["effort"] = effort.sampled_eval_by_level(engine, task, tokenizer, spec, seed=seed,
                                                    num_problems=num_records, split=split)
  title = f"{name} on {type(task).__name__}"
  paths = write_report(report, out_dir, title=title)
  if "effort" in report:
    paths.append(effort.write_level_plot(report["effort"], out_dir, title=title))
  return report, paths
