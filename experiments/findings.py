"""The field's findings reproduced in small: each is a few RL runs ("arms") on filler-padded
addition, then a plot, a table and a verdict.

    python experiments/findings.py --all [--tiny] [--report_dir runs/findings]
    python experiments/findings.py a e          # some of them

A finding is an entry of FINDINGS below (the seed result, its arms, how the verdict is read
off their metrics), its configs experiments/configs/findings/<letter>_*.gin (each arm's config
runs alone with experiments/run.py) and its notebook experiments/notebooks/findings/<key>.ipynb,
which calls `run`. The command executes the notebooks headless and writes them, executed, to
REPORT_DIR, with REPORT_DIR/report.md holding every finding's plot, table and verdict. Arms
are shared by name between findings and run once per report directory (a finished arm is read
back, an interrupted one resumes); all start from one SFT warm start of base.gin.
`--tiny` (LONGRL_FINDINGS_TINY=1 in a notebook) shrinks every run to a smoke test of
seconds: the tests run it so that nothing here rots.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gin  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import gin_externals, run as run_lib  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import long2short as long2short_lib, metrics as metrics_lib  # noqa: E402

CONFIGS = os.path.join(ROOT, "experiments/configs/findings")
NOTEBOOKS = os.path.join(ROOT, "experiments/notebooks/findings")
TINY = ["experiments/configs/tiny.gin"]
# The long model of finding h must solve some prompts even in the smoke test: more SFT.
TINY_BINDINGS = ["Arithmetic.filler = 1", "BUDGET = 10", "train.eval_every = 1",
                 "train.sft_steps = 300", "train.checkpoint_every = 100",
                 "Arithmetic.num_train = 2000",
                 "train.num_steps = 2", "SampledEval.samples = 4", "SampledEval.ks = (1, 4)",
                 "SampledEval.budgets = (16,)", "long2short.num_prompts = 8",
                 "long2short.steps = 3", "long2short.batch_size = 8",
                 "long2short.eval_records = 8", "long2short.max_new_tokens = 16",
                 "long2short.seq_len = 32", "long2short.samples = 4"]
WARM_START = "warm_start"


def report_dir() -> str:
  return os.environ.get("LONGRL_FINDINGS_DIR", os.path.join(ROOT, "runs/findings"))


def tiny() -> bool:
  return os.environ.get("LONGRL_FINDINGS_TINY") == "1"


# ----------------------------------------------------------------------------- arms

@dataclasses.dataclass(frozen=True)
class Arm:
  config: str  # a gin file in experiments/configs/findings
  label: str  # its name in plots and tables
  init_from: str = WARM_START  # the arm whose final params it starts from


ARMS = {
    "baseline": Arm("baseline.gin", "k1.5, correctness only"),
    "budget": Arm("a_budget.gin", "truncation budget"),
    "penalty_easy": Arm("b_easy.gin", "length penalty, easy prompts"),
    "penalty_hard": Arm("b_hard.gin", "length penalty, hard prompts"),
    "rest": Arm("c_rest.gin", "ReST (positive only)"),
    "prioritized": Arm("d_prioritized.gin", "prioritized (1 - s)"),
    "curriculum": Arm("d_curriculum.gin", "curriculum (easy first)"),
    "budget_mask_incorrect": Arm("f_mask_incorrect.gin", "budget, -I (mask incorrect)"),
    "budget_mask_long_correct": Arm("f_mask_long_correct.gin",
                                    "budget, -L&C (mask long correct)"),
    "budget_stale": Arm("g_stale.gin", "budget, 4 updates per batch"),
    "long2short_rl": Arm("h_long2short.gin", "long2short RL", init_from="baseline"),
}


@contextlib.contextmanager
def _configured(config: str, run_dir: str | None = None, bindings=()):
  """gin holding `config` (plus the tiny overrides in tiny mode) and `bindings`, with the
  repository root as working directory (gin includes are relative to it) until the end."""
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    gin.clear_config()
    files = [os.path.join(CONFIGS, config)] + ([os.path.join(ROOT, f) for f in TINY]
                                               if tiny() else [])
    extra = (TINY_BINDINGS if tiny() else []) + ["train.progress = False", *bindings]
    run_lib.load_config(files, extra, run_dir)
    yield
  finally:
    os.chdir(cwd)


def _finished(run_dir: str, key: str = "rl_accuracy") -> dict | None:
  """run_dir/summary.json if it exists and holds `key` (written at the end of a run)."""
  path = os.path.join(run_dir, "summary.json")
  summary = json.load(open(path)) if os.path.exists(path) else {}
  return summary if key in summary else None


def _train(config: str, run_dir: str, bindings=()) -> dict:
  summary = _finished(run_dir)
  if summary is None:
    started = time.perf_counter()
    _log(f"running {os.path.relpath(run_dir, report_dir())} ({config})")
    with _configured(config, run_dir, bindings):
      summary = gin_externals.train()
    seconds = time.perf_counter() - started
    _log(f"  done in {seconds:.0f} s: held-out accuracy {summary['sft_accuracy']:.3f} -> "
         f"{summary['rl_accuracy']:.3f}, mean length {summary['sft_length']:.1f} -> "
         f"{summary['rl_length']:.1f}")
    _record_time(os.path.basename(run_dir), seconds)
  return summary


def _log(message: str) -> None:
  """Print, and append to REPORT_DIR/progress.log (the notebooks' kernels print out of
  sight while `--all` runs them: `tail -f` that file)."""
  print(message, flush=True)
  os.makedirs(report_dir(), exist_ok=True)
  with open(os.path.join(report_dir(), "progress.log"), "a") as f:
    f.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def _record_time(name: str, seconds: float) -> None:
  """Wall-clock seconds per arm (and long2short method), kept in REPORT_DIR/timings.json."""
  path = os.path.join(report_dir(), "timings.json")
  timings = json.load(open(path)) if os.path.exists(path) else {}
  timings[name] = seconds
  with open(path, "w") as f:
    json.dump(timings, f, indent=2)


def minutes(names) -> float | None:
  """Minutes the named arms took when they ran (None if one was never timed here)."""
  path = os.path.join(report_dir(), "timings.json")
  timings = json.load(open(path)) if os.path.exists(path) else {}
  return (sum(timings[n] for n in names) / 60 if all(n in timings for n in names)
          else None)


def arm(name: str) -> dict:
  """Run arm `name` (and what it starts from) unless finished; returns {"summary",
  "records": metrics.jsonl, "label"}."""
  runs = os.path.join(report_dir(), "runs")
  if name == WARM_START:
    _train("base.gin", os.path.join(runs, WARM_START), ["train.num_steps = 0"])
    return {}
  spec = ARMS[name]
  arm(spec.init_from)
  run_dir = os.path.join(runs, name)
  summary = _train(spec.config, run_dir, [f"train.init_from = "
                                          f"{os.path.join(runs, spec.init_from)!r}"])
  return {"summary": summary, "label": spec.label,
          "records": metrics_lib.read(os.path.join(run_dir, "metrics.jsonl"))}


def series(data: dict, key: str):
  """(steps, values) of `key` over an arm's metrics records."""
  points = [(r["step"], r[key]) for r in data["records"] if key in r]
  return np.array([p[0] for p in points]), np.array([p[1] for p in points], float)


def smooth(values, window: int = 5):
  if len(values) < window:
    return np.asarray(values, float)
  padded = np.pad(np.asarray(values, float), (window // 2, window - 1 - window // 2), "edge")
  return np.convolve(padded, np.ones(window) / window, mode="valid")


def first_step_at_or_below(steps, values, level):
  hit = np.flatnonzero(values <= level)
  return int(steps[hit[0]]) if hit.size else int(steps[-1])


def head(values, n: int = 3) -> float:
  return float(np.mean(values[:n]))


def tail(values, fraction: float = 0.2) -> float:
  return float(np.mean(values[-max(1, int(len(values) * fraction)):]))


# ----------------------------------------------------------------------------- results

@dataclasses.dataclass
class Result:
  key: str
  title: str
  seed: str  # the published result being reproduced, with its source
  verdict: str  # "reproduced", "partially reproduced" or "not reproduced"
  why: str  # the numbers the verdict rests on
  table: list[dict]
  figure: plt.Figure
  minutes: float | None = None  # the warm start and the arms, as run on this machine

  def markdown_table(self) -> str:
    columns = list(self.table[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in self.table:
      lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines)

  def save(self, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    self.figure.savefig(os.path.join(out_dir, "plot.png"), dpi=110, bbox_inches="tight")
    with open(os.path.join(out_dir, "result.json"), "w") as f:
      json.dump({"key": self.key, "title": self.title, "seed": self.seed,
                 "verdict": self.verdict, "why": self.why, "table": self.table,
                 "minutes": self.minutes, "tiny": tiny()}, f, indent=2)

  def _repr_markdown_(self) -> str:
    return (f"**{self.title}: {self.verdict}.** {self.why}\n\n" + self.markdown_table())


def _cell(value) -> str:
  return f"{value:.3f}" if isinstance(value, float) else str(value)


def _curves(arms: dict, panels: list[tuple[str, str]], title: str, window: int = 5,
            marks: dict | None = None):
  """One panel per (metrics key, axis label), one line per arm; eval_* keys unsmoothed."""
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.3), squeeze=False)
  for ax, (key, label) in zip(axes[0], panels):
    for name, data in arms.items():
      steps, values = series(data, key)
      if not key.startswith("eval_"):
        values = smooth(values, window)
      ax.plot(steps, values, label=data["label"], marker="o" if key.startswith("eval_")
              else None, markersize=3)
    for name, step in (marks or {}).items():
      ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig


def _label(fig, ax, xlabel: str, ylabel: str, title: str) -> None:
  """Axis labels, grid, legend and title of a one-panel finding plot."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()


def _final_eval(data: dict, key: str = "eval_accuracy") -> float:
  """The mean of an arm's evaluations over the second half of its run: one evaluation on 128
  prompts has a standard error of about 0.035 at accuracy 0.8."""
  steps, values = series(data, key)
  return float(np.mean(values[steps > steps[-1] / 2])) if steps[-1] else float(values[-1])


def _start_eval(data: dict, key: str = "eval_accuracy") -> float:
  _, values = series(data, key)
  return float(values[0])


# ----------------------------------------------------------------------------- the findings

def two_stages(arms):
  """a. Under a length budget: length falls first, then accuracy within the budget rises."""
  budget = arms["budget"]
  steps, length = series(budget, "completion_length")
  _, reward = series(budget, "reward")  # = correct and within the budget
  length_s, reward_s = smooth(length), smooth(reward)
  start, end = head(length_s), tail(length_s)
  drop = start - end
  adapted = first_step_at_or_below(steps, length_s, end + 0.1 * drop)
  reward_at_adapted = float(reward_s[list(steps).index(adapted)])
  reward_end = tail(reward_s)
  eval_steps, acc_eval = series(budget, "eval_accuracy")
  low = int(np.argmin(acc_eval))
  fell = drop >= 0.25 * start
  early = adapted <= 0.6 * steps[-1]
  refined = reward_end >= reward_at_adapted + 0.03
  verdict = ("reproduced" if fell and early and refined else
             "partially reproduced" if fell else "not reproduced")
  why = (f"mean length {start:.1f} -> {end:.1f} tokens, 90% of the fall done by step "
         f"{adapted} of {steps[-1]}; within-budget accuracy (train) {reward_at_adapted:.3f} "
         f"there and {reward_end:.3f} at the end (last 20%); held-out greedy accuracy "
         f"{acc_eval[0]:.3f} at the start, {acc_eval[low]:.3f} at its lowest (step "
         f"{eval_steps[low]}), {acc_eval[-1]:.3f} at the end.")
  table = [{"arm": d["label"], "length start": head(smooth(series(d, "completion_length")[1])),
            "length end": tail(smooth(series(d, "completion_length")[1])),
            "train accuracy end": tail(series(d, "accuracy")[1]),
            "reward end": tail(series(d, "reward")[1]),
            "held-out acc. start": _start_eval(d), "held-out acc., 2nd half": _final_eval(d)}
           for d in arms.values()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("reward", "reward (budget arm: correct within budget)"),
                       ("eval_accuracy", "held-out greedy accuracy")],
                "a. length budget: length first, then accuracy", marks={"adapted": adapted})
  return verdict, why, table, fig


def easy_vs_hard(arms):
  """b. Length penalty on hard prompts only collapses; on easy prompts it stays stable."""
  rows, signs = [], {}
  for name, data in arms.items():
    _, length = series(data, "completion_length")
    _, entropy = series(data, "entropy")
    l0, l1 = head(smooth(length)), tail(smooth(length))
    e0, emax = head(entropy), float(np.max(smooth(entropy)))
    a0, a1 = _start_eval(data), _final_eval(data)
    signs[name] = {"length crash": l1 < 0.5 * l0, "entropy spike": emax > 1.5 * e0,
                   "accuracy falls": a1 < a0 - 0.1}
    rows.append({"arm": data["label"], "length start": l0, "length end": l1,
                 "entropy start": e0, "entropy max": emax, "held-out acc. start": a0,
                 "held-out acc., 2nd half": a1})
  hard, easy = signs["penalty_hard"], signs["penalty_easy"]
  collapsed = hard["accuracy falls"] and (hard["length crash"] or hard["entropy spike"])
  stable = not any(easy.values())
  verdict = ("reproduced" if collapsed and stable else
             "partially reproduced" if collapsed or (stable and any(hard.values()))
             else "not reproduced")
  why = ("hard prompts: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in hard.items())
         + "; easy prompts: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                          for k, v in easy.items()) + ".")
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("entropy", "entropy"), ("eval_accuracy", "held-out greedy accuracy")],
                "b. length penalty on easy vs hard prompts")
  return verdict, why, rows, fig


def _accuracy_table(arms):
  return [{"arm": d["label"], "held-out acc. start": _start_eval(d),
           "held-out acc., 2nd half": _final_eval(d),
           "train acc. end": tail(series(d, "accuracy")[1]),
           "length end": tail(series(d, "completion_length")[1])} for d in arms.values()]


def negative_gradients(arms):
  """c. k1.5 (uses failed samples) vs ReST (successes only) at equal samples."""
  k15, rest = _final_eval(arms["baseline"]), _final_eval(arms["rest"])
  verdict = "reproduced" if k15 >= rest + 0.03 else "not reproduced"
  why = (f"held-out greedy accuracy over the second half of the run (mean of its "
         f"evaluations): k1.5 {k15:.3f}, ReST {rest:.3f}, from "
         f"{_start_eval(arms['baseline']):.3f} after SFT; a gap under 0.03 counts as none.")
  fig = _curves(arms, [("eval_accuracy", "held-out greedy accuracy"),
                       ("accuracy", "train accuracy"), ("entropy", "entropy")],
                "c. negative gradients: k1.5 vs ReST")
  return verdict, why, _accuracy_table(arms), fig


def samplers(arms):
  """d. Curriculum and prioritized sampling vs uniform at equal steps."""
  uniform = _final_eval(arms["baseline"])
  gains = {name: _final_eval(arms[name]) - uniform for name in ("prioritized", "curriculum")}
  wins = [name for name, gain in gains.items() if gain >= 0.03]
  verdict = ("reproduced" if len(wins) == 2 else "partially reproduced" if wins
             else "not reproduced")
  why = (f"held-out greedy accuracy over the second half of the run: uniform {uniform:.3f}, "
         + ", ".join(f"{name} {uniform + gain:.3f} ({gain:+.3f})"
                     for name, gain in gains.items()) + "; a gain under 0.03 counts as none.")
  fig = _curves(arms, [("eval_accuracy", "held-out greedy accuracy"),
                       ("accuracy", "train accuracy")], "d. prompt sampling at equal steps")
  return verdict, why, _accuracy_table(arms), fig


def coverage(arms):
  """e. mean@k rises under RL while pass@k at large k stays flat or falls."""
  data = arms["baseline"]
  ks = sorted({int(k.split("@")[1]) for r in data["records"] for k in r
               if k.startswith("eval_pass@")})
  k_max = ks[-1]
  steps, mean_k = series(data, f"eval_mean@{k_max}")
  _, pass_k = series(data, f"eval_pass@{k_max}")
  d_mean, d_pass = mean_k[-1] - mean_k[0], pass_k[-1] - pass_k[0]
  verdict = ("reproduced" if d_mean >= 0.05 and d_pass <= 0.02 else
             "partially reproduced" if d_mean >= 0.05 and d_pass < d_mean
             else "not reproduced")
  why = (f"over RL, mean@{k_max} {mean_k[0]:.3f} -> {mean_k[-1]:.3f} ({d_mean:+.3f}), "
         f"pass@{k_max} {pass_k[0]:.3f} -> {pass_k[-1]:.3f} ({d_pass:+.3f}).")
  table = [{"step": int(s), **{f"pass@{k}": float(series(data, f"eval_pass@{k}")[1][i])
                               for k in ks},
            f"mean@{k_max}": float(mean_k[i]),
            f"maj@{k_max}": float(series(data, f"eval_maj@{k_max}")[1][i])}
           for i, s in enumerate(steps)]
  fig, ax = plt.subplots(figsize=(5, 3.4))
  for k in ks:
    ax.plot(steps, series(data, f"eval_pass@{k}")[1], marker="o", markersize=3,
            label=f"pass@{k}")
  ax.plot(steps, mean_k, marker="s", markersize=3, linestyle="--", label=f"mean@{k_max}")
  _label(fig, ax, "RL step", "held-out, sampled at T=1",
         "e. coverage (pass@k) vs sharpening (mean@k)")
  return verdict, why, table, fig


def masking(arms):
  """f. -I drives the policy to short nonsense; -L&C keeps longer reasoning."""
  end = {name: {"length": tail(series(d, "completion_length")[1]),
                "accuracy": _final_eval(d),
                "well_formed": tail(series(d, "well_formed")[1])}
         for name, d in arms.items()}
  base, minus_i, minus_lc = (end["budget"], end["budget_mask_incorrect"],
                             end["budget_mask_long_correct"])
  nonsense = (minus_i["length"] < 0.7 * base["length"]
              and (minus_i["accuracy"] < base["accuracy"] - 0.1
                   or minus_i["well_formed"] < 0.8))
  longer = (minus_lc["length"] > base["length"] + 1.0
            and minus_lc["accuracy"] >= base["accuracy"] - 0.05)
  verdict = ("reproduced" if nonsense and longer else
             "partially reproduced" if nonsense or longer else "not reproduced")
  why = ("at the end, " + "; ".join(
      f"{arms[n]['label']}: length {e['length']:.1f}, held-out acc. {e['accuracy']:.3f}, "
      f"well-formed {e['well_formed']:.2f}" for n, e in end.items()) + ".")
  table = [{"arm": arms[n]["label"], "length end": e["length"],
            "held-out acc., 2nd half": e["accuracy"], "well-formed end": e["well_formed"]}
           for n, e in end.items()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("eval_accuracy", "held-out greedy accuracy"),
                       ("well_formed", "well-formed fraction")],
                "f. masking instead of zero reward")
  return verdict, why, table, fig


def staleness(arms):
  """g. Stale (off-policy) updates speed up length adaptation but raise entropy later."""
  stats = {}
  for name, data in arms.items():
    steps, length = series(data, "completion_length")
    _, entropy = series(data, "entropy")
    length_s = smooth(length)
    start, end = head(length_s), tail(length_s)
    half = first_step_at_or_below(steps, length_s, start - 0.5 * (start - end))
    stats[name] = {"half": half, "entropy_late": tail(entropy, 0.25), "start": start,
                   "end": end}
  on, off = stats["budget"], stats["budget_stale"]
  faster = off["half"] <= 0.8 * on["half"]
  hotter = off["entropy_late"] > 1.1 * on["entropy_late"]
  verdict = ("reproduced" if faster and hotter else
             "partially reproduced" if faster or hotter else "not reproduced")
  why = (f"half of the length fall reached at step {on['half']} on-policy vs {off['half']} "
         f"with 4 updates per batch; entropy over the last quarter {on['entropy_late']:.3f} "
         f"vs {off['entropy_late']:.3f}.")
  table = [{"arm": arms[n]["label"], "length start": s["start"], "length end": s["end"],
            "step at half the fall": s["half"], "entropy, last quarter": s["entropy_late"],
            "held-out acc., 2nd half": _final_eval(arms[n])} for n, s in stats.items()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("entropy", "entropy"), ("eval_accuracy", "held-out greedy accuracy")],
                "g. off-policy staleness")
  return verdict, why, table, fig


def _evaluate_policy(run_dir: str) -> dict:
  """rl.long2short.evaluate of `run_dir`'s latest params under h_long2short.gin's task and
  sizes, cached in run_dir/long2short_eval.json."""
  path = os.path.join(run_dir, "long2short_eval.json")
  if not os.path.exists(path):
    with _configured("h_long2short.gin"):
      task = gin.query_parameter("long2short.task").scoped_configurable_fn()
      tokenizer = CharTokenizer()
      cfg = gin.query_parameter("long2short.model").scoped_configurable_fn(
          tokenizer.vocab_size)
      result = long2short_lib.evaluate(
          long2short_lib.load(run_dir, cfg), cfg, task, tokenizer,
          num_records=gin.query_parameter("long2short.eval_records"),
          max_new_tokens=gin.query_parameter("long2short.max_new_tokens"))
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  return json.load(open(path))


def long2short_methods(arms):
  """h. long2short: every method shortens; RL gives the best accuracy for its length."""
  runs = os.path.join(report_dir(), "runs")
  l2s_dir = os.path.join(runs, "long2short")
  short_dir = os.path.join(l2s_dir, "shortest_rejection")
  dirs = {"long model": os.path.join(runs, "baseline")}
  for method, extra in (("shortest_rejection", {}), ("dpo", {}),
                        ("merge", {"merge_with": short_dir})):
    out = os.path.join(l2s_dir, method)
    if _finished(out, "accuracy") is None:
      _log(f"running long2short {method}")
      started = time.perf_counter()
      with _configured("h_long2short.gin",
                       bindings=[f"long2short.long_run = {dirs['long model']!r}"]):
        gin_externals.long2short(out, method=method, progress=False, **extra)
      _record_time(f"long2short_{method}", time.perf_counter() - started)
    dirs[method.replace("_", " ")] = out
  dirs["long2short RL"] = os.path.join(runs, "long2short_rl")
  # Every model measured alike: sampled (T = 1, 4 per prompt) accuracy and mean length, the
  # quantities long2short trades; greedy decoding shows only the most likely length.
  measured = {m: _evaluate_policy(d) for m, d in dirs.items()}
  points = {m: (e["sampled_length"], e["sampled_accuracy"]) for m, e in measured.items()}
  long_length, long_accuracy = points["long model"]
  # A method works if it cuts at least 10% of the tokens and loses at most 0.05 accuracy.
  works = {m: n <= 0.9 * long_length and a >= long_accuracy - 0.05
           for m, (n, a) in points.items() if m != "long model"}
  rl_length, rl_acc = points["long2short RL"]
  dominated = [m for m, (n, a) in points.items()
               if m != "long2short RL" and n <= rl_length and a >= rl_acc
               and (n, a) != (rl_length, rl_acc)]
  verdict = ("reproduced" if all(works.values()) and not dominated else
             "partially reproduced" if any(works.values()) else "not reproduced")
  why = ("sampled held-out (accuracy, mean tokens): " + "; ".join(
      f"{m} ({a:.3f}, {n:.1f})" for m, (n, a) in points.items())
         + "; cut >= 10% of the tokens within 0.05 accuracy: "
         + (", ".join(m for m, ok in works.items() if ok) or "none")
         + (f"; long2short RL is dominated by {', '.join(dominated)}" if dominated else
            "; no other model is both shorter and more accurate than long2short RL") + ".")
  table = [{"model": m, "sampled acc.": e["sampled_accuracy"],
            "sampled mean tokens": e["sampled_length"], "greedy acc.": e["accuracy"],
            "greedy tokens": e["length"]} for m, e in measured.items()]
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for m, (n, a) in points.items():
    ax.scatter(n, a, s=40, label=m, marker="*" if m == "long model" else "o")
  _label(fig, ax, "mean completion tokens (held-out, sampled)",
         "held-out accuracy (sampled, T=1)",
         "h. long2short: accuracy vs tokens (k1.5 Fig. 7 shape)")
  return verdict, why, table, fig


@dataclasses.dataclass(frozen=True)
class Finding:
  key: str  # also the notebook's name
  title: str
  seed: str
  arms: tuple[str, ...]
  analyse: Callable


FINDINGS = {f.key: f for f in [
    Finding("a_two_stages", "a. Length penalty's two stages",
            "Under a length budget, training first shortens responses (length adaptation), "
            "then accuracy within the shorter budget recovers (reasoning refinement) "
            "[The Art of Efficient Reasoning, arXiv 2602.20945, sec. 3].",
            ("budget", "baseline"), two_stages),
    Finding("b_easy_vs_hard", "b. Easy vs hard prompts under a length penalty",
            "Training with a length penalty on hard prompts only collapses (length crashes, "
            "entropy spikes, accuracy falls); on easy prompts it stays stable and generalises "
            "[arXiv 2602.20945].", ("penalty_easy", "penalty_hard"), easy_vs_hard),
    Finding("c_negative_gradients", "c. Negative gradients: k1.5 vs ReST",
            "At equal samples the k1.5 objective, which also learns from failed samples, "
            "beats ReST (positive-only fine-tuning) [Kimi k1.5, arXiv 2501.12599, sec. 3.5].",
            ("baseline", "rest"), negative_gradients),
    Finding("d_sampling", "d. Curriculum and prioritized sampling",
            "Curriculum sampling (easy first) and prioritized sampling (p ~ 1 - success rate) "
            "both beat uniform sampling at equal steps [Kimi k1.5, sec. 2.3.4 and 3.5].",
            ("baseline", "prioritized", "curriculum"), samplers),
    Finding("e_coverage", "e. Coverage vs sharpening",
            "RL sharpens the distribution: mean@k (pass@1) rises while pass@k at large k "
            "stays flat or falls [Yue et al. 2025, arXiv 2504.13837].",
            ("baseline",), coverage),
    Finding("f_masking", "f. Masking incorrect vs long-correct completions",
            "Masking incorrect answers out of the loss (\"-I\") drives the policy to short "
            "nonsense; masking long correct ones (\"-L&C\") keeps longer reasoning "
            "[arXiv 2602.20945].",
            ("budget", "budget_mask_incorrect", "budget_mask_long_correct"), masking),
    Finding("g_staleness", "g. Off-policy staleness",
            "Mildly stale (off-policy) updates speed up the length-adaptation phase but raise "
            "entropy later [arXiv 2602.20945].", ("budget", "budget_stale"), staleness),
    Finding("h_long2short", "h. long2short",
            "From a long-CoT model, shortest-rejection SFT, DPO, weight merging and "
            "long2short RL all cut tokens; long2short RL gives the best accuracy for its "
            "length [Kimi k1.5, sec. 2.4 and Fig. 7].",
            ("baseline", "long2short_rl"), long2short_methods),
]}


def run(key: str) -> Result:
  """Run (or read back) finding `key`'s arms, analyse them, save REPORT_DIR/<key>/."""
  finding = FINDINGS[key]
  arms = {name: arm(name) for name in finding.arms}
  verdict, why, table, figure = finding.analyse(arms)
  needed = {WARM_START, *finding.arms, *(ARMS[a].init_from for a in finding.arms)}
  if key == "h_long2short":
    needed |= {f"long2short_{m}" for m in ("shortest_rejection", "dpo", "merge")}
  result = Result(key, finding.title, finding.seed, verdict, why, table, figure,
                  minutes(needed))
  result.save(os.path.join(report_dir(), key))
  return result


# ----------------------------------------------------------------------------- headless

def execute_notebooks(keys, out_dir: str, *, timeout: int = 3600) -> None:
  """Execute the findings' notebooks with nbclient (they read LONGRL_FINDINGS_DIR and
  LONGRL_FINDINGS_TINY) and write them, executed, to out_dir."""
  import nbformat
  from nbclient import NotebookClient

  # The kernels compile the same small programs again and again: share them on disk.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(out_dir, ".jax_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

  for key in keys:
    path = os.path.join(NOTEBOOKS, f"{key}.ipynb")
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    print(f"[{key}] executing {os.path.relpath(path, ROOT)} (progress: "
          f"{os.path.join(out_dir, 'progress.log')})", flush=True)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    nbformat.write(nb, os.path.join(out_dir, f"{key}.ipynb"))
    verdict = json.load(open(os.path.join(out_dir, key, "result.json")))["verdict"]
    print(f"[{key}] {verdict} ({time.perf_counter() - started:.0f} s)", flush=True)


def write_report(keys, out_dir: str) -> str:
  lines = ["# Findings reproduced in small", "",
           "Each finding: the published result, what our small run shows, and the verdict. "
           "Reproduce with `python experiments/findings.py --all`" +
           (" (this report: --tiny, a smoke test; its numbers mean nothing)" if tiny() else "")
           + ".", "", "| finding | verdict | minutes on this machine (alone) |", "|---|---|---|"]
  results = [json.load(open(os.path.join(out_dir, key, "result.json"))) for key in keys]
  lines += [f"| {r['title']} | {r['verdict']} | {_minutes(r['minutes'])} |" for r in results]
  for r in results:
    columns = list(r["table"][0])
    lines += ["", f"## {r['title']}", "", f"Seed result: {r['seed']}", "",
              f"**{r['verdict'].capitalize()}.** {r['why']}", "",
              f"![{r['key']}]({r['key']}/plot.png)", "",
              "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in r["table"]]
  path = os.path.join(out_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def _minutes(value) -> str:
  return "-" if value is None else f"{value:.1f}"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("keys", nargs="*", help="findings by letter (a..h) or name")
  parser.add_argument("--all", action="store_true", help="every finding")
  parser.add_argument("--tiny", action="store_true", help="a smoke test of seconds each")
  parser.add_argument("--report_dir", default=None, help="default: runs/findings")
  args = parser.parse_args(argv)
  by_letter = {key[0]: key for key in FINDINGS}
  keys = list(FINDINGS) if args.all else [by_letter.get(k, k) for k in args.keys]
  unknown = [k for k in keys if k not in FINDINGS]
  if not keys or unknown:
    parser.error(f"unknown finding(s) {unknown}; valid: {', '.join(FINDINGS)} (or a..h), "
                 "or --all" if unknown else "name findings (a..h) or give --all")
  os.environ["LONGRL_FINDINGS_DIR"] = os.path.abspath(args.report_dir or report_dir())
  if args.tiny:
    os.environ["LONGRL_FINDINGS_TINY"] = "1"
  out_dir = report_dir()
  os.makedirs(out_dir, exist_ok=True)
  execute_notebooks(keys, out_dir)
  print(f"report: {write_report(keys, out_dir)}")


if __name__ == "__main__":
  main()
