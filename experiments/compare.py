"""Compare runs: run directories in (each one run, or seed<k>/ runs as experiments/seeds.py
writes them), one figure and one table out.

    python experiments/compare.py RUN_A RUN_B [RUN ...] [--metrics reward eval_accuracy ...]
        [--labels A B ...] [--out DIR] [--last 0.2] [--window 5] [--ci t|bootstrap]

The figure has one panel per metric of metrics.jsonl: per run the mean over seeds and a band
from the lowest to the highest seed at each step (train metrics smoothed over `window`
steps, eval_* ones not). The table gives per run and metric the mean over seeds of its final
value and a 95% interval (experiments/stats.py), and each later run's difference from the
first, paired by seed. A metric's final value is summary.json's when the run wrote it there
(rl_accuracy, rl_length, ...), else the mean over the last `last` fraction of the steps that
logged it. Writes DIR/compare.png, compare.md (the table, also printed) and compare.json;
DIR defaults to a `compare` directory beside the first run. Reads runs only: making them is
experiments/seeds.py's (or run.py's) business.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments import seeds as seeds_lib, stats  # noqa: E402

METRICS = ("reward", "accuracy", "completion_length", "entropy", "eval_accuracy")


def smooth(values, window: int = 5):
  """Moving average over `window` points, the ends padded with the edge values."""
  values = np.asarray(values, float)
  if window <= 1 or len(values) < window:
    return values
  padded = np.pad(values, (window // 2, window - 1 - window // 2), "edge")
  return np.convolve(padded, np.ones(window) / window, mode="valid")


def series(run: dict, key: str):
  """(steps, values) of `key` over one run's metrics records."""
  points = [(r["step"], r[key]) for r in run["records"] if key in r]
  return np.array([p[0] for p in points], int), np.array([p[1] for p in points], float)


def stack(runs: dict[int, dict], key: str, *, window: int = 1):
  """(steps, values f32[seeds, steps]) of `key`, each seed smoothed over `window`, on the
  steps every seed logged (seeds that never logged `key` left out)."""
  curves = {}
  for seed, run in runs.items():
    steps, values = series(run, key)
    if len(steps):
      curves[seed] = dict(zip(steps.tolist(), smooth(values, window)))
  if not curves:
    return np.zeros(0, int), np.zeros((0, 0))
  common = sorted(set.intersection(*(set(c) for c in curves.values())))
  return np.array(common, int), np.array([[c[s] for s in common] for c in curves.values()])


def draw(ax, runs: dict[int, dict], key: str, *, label: str, window: int = 1, **plot_kw):
  """The mean over seeds of `key` against step, and a band from the lowest to the highest
  seed (with two seeds or more)."""
  steps, values = stack(runs, key, window=window)
  if not len(steps):
    return
  line, = ax.plot(steps, values.mean(axis=0), label=label, **plot_kw)
  if len(values) > 1:
    ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=line.get_color(),
                    alpha=0.2, linewidth=0)


def final(runs: dict[int, dict], key: str, *, last: float = 0.2) -> dict[int, float]:
  """{seed: final value of `key`}: summary.json's value if there, else the mean over the last
  `last` fraction of the steps that logged it; seeds without it left out."""
  values = {}
  for seed, run in runs.items():
    if isinstance(run["summary"].get(key), (int, float)):
      values[seed] = float(run["summary"][key])
      continue
    _, points = series(run, key)
    if len(points):
      values[seed] = float(np.mean(points[-max(1, int(len(points) * last)):]))
  return values


def figure(named: dict[str, dict], metrics, *, window: int = 5) -> Figure:
  """One panel per metric logged in metrics.jsonl, one banded line per run."""
  logged = [m for m in metrics
            if any(m in r for runs in named.values() for run in runs.values()
                   for r in run["records"])]
  fig = Figure(figsize=(4.2 * max(1, len(logged)), 3.3))
  axes = fig.subplots(1, max(1, len(logged)), squeeze=False)[0]
  for ax, key in zip(axes, logged):
    for label, runs in named.items():
      eval_key = key.startswith("eval_")
      draw(ax, runs, key, label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})",
           window=1 if eval_key else window, marker="o" if eval_key else None, markersize=3)
    ax.set_xlabel("RL step")
    ax.set_title(key, fontsize=9)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  return fig


def table(named: dict[str, dict], metrics, *, last: float = 0.2, method: str = "t") -> dict:
  """{"runs": {label: {metric: {"per_seed", "mean", "low", "high", "n", "text", ...}}},
  "differences": {"B - A": {metric: ...}}} (paired on the seeds both ran)."""
  finals = {label: {m: final(runs, m, last=last) for m in metrics}
            for label, runs in named.items()}
  def cell(values):
    if not values:
      return None
    interval = stats.mean_ci(list(values.values()), method=method)
    return {"per_seed": values, **interval.as_dict(), "text": str(interval)}

  out = {"runs": {label: {m: cell(v) for m, v in by_metric.items()}
                  for label, by_metric in finals.items()}, "differences": {}}
  (first, reference), *others = finals.items()
  for label, by_metric in others:
    row = {}
    for m in metrics:
      common = sorted(set(by_metric[m]) & set(reference[m]))
      row[m] = cell(stats.paired_differences({s: by_metric[m][s] for s in common},
                                             {s: reference[m][s] for s in common}))
    out["differences"][f"{label} - {first}"] = row
  return out


def markdown(result: dict, metrics) -> str:
  fmt = lambda c: "-" if c is None else c["text"]
  head = "| run | " + " | ".join(metrics) + " |\n|" + "---|" * (len(metrics) + 1)
  lines = ["Final values: mean over seeds [95% interval].", "", head]
  lines += [f"| {label} | " + " | ".join(fmt(row[m]) for m in metrics) + " |"
            for label, row in result["runs"].items()]
  if result["differences"]:
    lines += ["", "Differences from the first run, paired by seed.", "",
              head.replace("| run |", "| difference |", 1)]
    lines += [f"| {label} | " + " | ".join(fmt(row[m]) for m in metrics) + " |"
              for label, row in result["differences"].items()]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("runs", nargs="+", help="run directories (one run or seed<k>/ runs)")
  parser.add_argument("--metrics", nargs="+", default=list(METRICS))
  parser.add_argument("--labels", nargs="+", help="one per run (default: directory names)")
  parser.add_argument("--out", help="default: RUN_A/../compare")
  parser.add_argument("--last", type=float, default=0.2,
                      help="final value: mean over this last fraction of the steps")
  parser.add_argument("--window", type=int, default=5, help="smoothing of train metrics")
  parser.add_argument("--ci", choices=stats.METHODS, default="t")
  args = parser.parse_args(argv)
  labels = args.labels or [os.path.basename(os.path.normpath(r)) for r in args.runs]
  if len(labels) != len(args.runs) or len(set(labels)) != len(labels):
    parser.error(f"give one distinct label per run (--labels), got {labels}")
  try:
    named = {label: seeds_lib.read(r) for label, r in zip(labels, args.runs)}
  except FileNotFoundError as e:
    raise SystemExit(f"error: {e}") from None
  out = args.out or os.path.join(os.path.dirname(os.path.normpath(args.runs[0])), "compare")
  os.makedirs(out, exist_ok=True)
  result = table(named, args.metrics, last=args.last, method=args.ci)
  result["run_dirs"] = dict(zip(labels, args.runs))
  text = markdown(result, args.metrics)
  print(text)
  with open(os.path.join(out, "compare.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "compare.json"), "w") as f:
    json.dump(result, f, indent=2)
  figure(named, args.metrics, window=args.window).savefig(os.path.join(out, "compare.png"),
                                                          dpi=110, bbox_inches="tight")
  names = ("compare.png", "compare.md", "compare.json")
  print("wrote " + ", ".join(os.path.join(out, n) for n in names))
  return result


if __name__ == "__main__":
  main()
