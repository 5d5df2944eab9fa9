"""A run's metrics on disk: metrics.jsonl (one JSON object per step, appended) and the PNG
plot drawn from it. Owns the file format; the loop decides what goes in."""

import json
import os
from typing import Any, Iterable

from matplotlib.figure import Figure

PLOTTED = (("reward", "reward"), ("accuracy", "train accuracy"),
           ("completion_length", "mean completion length"), ("entropy", "entropy"))


def append(path: str, record: dict[str, Any]) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def read(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate(path: str, last_step: int) -> int:
  """Keep the records of steps <= last_step (a run resumed from an older checkpoint redoes
  the later ones); the others move to `<path>.discarded` rather than being deleted.
  Returns how many moved. Any JSONL file of records with a "step" (samples.jsonl too)."""
  records = read(path)
  later = [r for r in records if r["step"] > last_step]
  if later:
    with open(path + ".discarded", "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in later)
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records if r["step"] <= last_step)
  return len(later)


def plot(records: Iterable[dict[str, Any]], png_path: str | None = None, *,
         keys=PLOTTED, title: str = ""):
  """One panel per metric against step; eval_accuracy is drawn on the accuracy panel.

  Returns the matplotlib Figure (built without pyplot, so no backend is touched); with
  `png_path` it is also saved there.
  """
  records = list(records)
  fig = Figure(figsize=(4 * len(keys), 3.2))
  axes = fig.subplots(1, len(keys))
  for ax, (key, label) in zip(axes, keys):
    points = [(r["step"], r[key]) for r in records if key in r]
    if points:
      ax.plot(*zip(*points), lw=1.2, label=label)
    if key == "accuracy":
      evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
      if evals:
        ax.plot(*zip(*evals), "o-", lw=1.2, label="held-out accuracy (greedy)")
      ax.legend(fontsize=7)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  if png_path:
    fig.savefig(png_path, dpi=110)
  return fig
