"""Evaluation reports on disk: a sampled evaluation's report.json and plots, one curve per
effort level, and the evaluation of a saved checkpoint (experiments/eval.py's command).

Owns the files and the figures; the evaluation itself and its metrics are rl/eval.py's.
"""

import json
import os
from typing import Any, Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from models import hf  # noqa: E402
from models.tokenizer import CharTokenizer, ChatPrompts, HFTokenizer  # noqa: E402
from rl import effort  # noqa: E402
from rl import eval as eval_lib  # noqa: E402
from rl.checkpoint import Checkpointer  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402


def write_report(report: dict[str, Any], out_dir: str, *, title: str = "") -> list[str]:
  """report.json plus three plots in `out_dir`: accuracy vs budget, length histograms by
  correctness, pass@k / maj@k / mean@k vs k at the largest budget. Returns the paths."""
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
  ax.set(xlabel="token budget", ylabel="accuracy", ylim=(-0.02, 1.02), title=title)
  if len(budgets) > 1 and budgets[-1] / budgets[0] >= 8:
    ax.set_xscale("log", base=2)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_level_plot(by_level: dict[str, dict], out_dir: str, *, title: str = "") -> str:
  """accuracy_vs_budget_by_effort.png in `out_dir`: accuracy (mean correctness within the
  budget) vs token budget, one curve per effort level, each labelled with its mean length."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "accuracy_vs_budget_by_effort.png")
  fig, ax = plt.subplots(figsize=(6, 4))
  budgets = []
  for level, report in by_level.items():
    keys = sorted(report["budgets"], key=int)  # ints in memory, strings from report.json
    budgets = [int(b) for b in keys]
    ax.plot(budgets, [report["budgets"][b]["accuracy"] for b in keys], marker="o",
            label=f"{level} (mean {effort.mean_length(report):.1f} tokens)")
  save_budget_plot(fig, ax, budgets, title or "accuracy vs budget per effort level", path)
  return path


def evaluate_checkpoint(out_dir: str, *, task,
                        spec: eval_lib.SampledEval = eval_lib.SampledEval(),
                        run_dir: str | None = None, model=None,
                        hf_checkpoint: str | None = None, num_records: int = 64,
                        split: str = "test", seed: int = 0) -> tuple[dict, list[str]]:
  """`sampled_eval` of a checkpoint on the first `num_records` of `split`, written to
  `out_dir` (see `write_report`). Give `run_dir` (a longrl run: its latest RL checkpoint,
  with `model` the same config factory the run used, e.g. models.config.tiny) or
  `hf_checkpoint` (a Hugging Face checkpoint directory). For an rl.effort.EffortTask the
  sweep also runs once per effort level on the first `num_records` problems (report
  "effort", plot accuracy_vs_budget_by_effort.png: one curve per level)."""
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
  report = eval_lib.sampled_eval(engine, task, tokenizer, records, spec, seed=seed)
  report["checkpoint"] = run_dir or hf_checkpoint
  if isinstance(task, effort.EffortTask):  # the sweep once per level, the same problems each
    report["effort"] = effort.sampled_eval_by_level(engine, task, tokenizer, spec, seed=seed,
                                                    num_problems=num_records, split=split)
  title = f"{name} on {type(task).__name__}"
  paths = write_report(report, out_dir, title=title)
  if "effort" in report:
    paths.append(write_level_plot(report["effort"], out_dir, title=title))
  return report, paths
