"""The field's findings reproduced in small: each is a few RL runs ("arms") on filler-padded
addition, repeated over seeds, then a plot, a table of intervals and a verdict.

    python experiments/findings.py --all [--seeds 5] [--jobs N] [--tiny] [--report_dir DIR]
    python experiments/findings.py a e          # some of them
    python experiments/findings.py a2 c2 f3     # later designs of a, c and f

A finding is an entry of FINDINGS below (the published claim, its arms, how its predicted
differences are read off their metrics), its configs experiments/configs/findings/<letter>_*.gin
(each arm's config runs alone with experiments/run.py) and its notebook
experiments/notebooks/findings/<key>.ipynb, which calls `run`.

Every arm runs once per seed k in REPORT_DIR/runs/<arm>/seed<k> with `train.seed = k`,
starting from that seed's own SFT warm start (runs/warm_start/seed<k>, base.gin). The command
first runs every run the named findings need through experiments/seeds.py (subprocesses of
run.py, eval.py and long2short.py, `--jobs` at a time; with `--tiny`, `--jobs` worker processes
that each run job after job in themselves; finished runs are read back, half-done ones
resume), then executes the notebooks headless, two kernels at a time, which only analyse, and
writes them, executed, to REPORT_DIR, with REPORT_DIR/report.md holding every finding's plot, intervals and
verdict and REPORT_DIR/<key>/results.json its numbers.

A finding's numbers are computed per seed; each predicted difference (a paired difference
between arms on the same seeds, or a change within one arm) gets a mean and a 95% interval
over seeds (experiments/stats.py: t, or `--ci bootstrap`) and a verdict from it: reproduced
(the interval excludes zero in the predicted direction), not reproduced (it excludes zero
the other way, or lies within the check's margin: no effect), too wide to tell. A claim of
several parts is reproduced when every part is. One seed gives "one seed: no interval".
`--tiny` (LONGRL_FINDINGS_TINY=1 in a notebook) shrinks every run to a smoke test of
seconds: the tests run it so that nothing here rots.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Callable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gin  # noqa: E402
import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import compare, findings_report, run as run_lib, seeds as seeds_lib  # noqa: E402
from experiments import stats  # noqa: E402
from experiments import gin_externals  # noqa: E402, F401  (what _configured parses)
from experiments.compare import series, smooth  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import long2short as long2short_lib  # noqa: E402

CONFIGS = os.path.join(ROOT, "experiments/configs/findings")
NOTEBOOKS = os.path.join(ROOT, "experiments/notebooks/findings")
TINY = ["experiments/configs/tiny.gin"]
# The long model of finding h must solve some prompts even in the smoke test: more SFT.
TINY_BINDINGS = ["Arithmetic.filler = 1", "BUDGET = 10", "Evaluation.every = 2",
                 "WarmStart.steps = 300", "Hooks.checkpoint_every = 100",
                 "Arithmetic.num_train = 2000",
                 "RLConfig.num_steps = 2", "SampledEval.samples = 4", "SampledEval.ks = (1, 4)",
                 "SampledEval.budgets = (16,)", "Long2ShortConfig.num_prompts = 8",
                 "Long2ShortConfig.steps = 3", "Long2ShortConfig.batch_size = 8",
                 "Long2ShortConfig.eval_records = 8", "Long2ShortConfig.max_new_tokens = 16",
                 "Long2ShortConfig.seq_len = 32", "Long2ShortConfig.samples = 4"]
WARM_START = "warm_start"
# Every SFT warm start, by name: its config (run with num_steps 0). The later designs of a, b,
# c, d, e and f change the task, so they start from warm starts of their own.
WARM_STARTS = {WARM_START: "base.gin", "warm_start_3op": "base_3op.gin",
               "warm_start_4digit": "d2_base.gin", "warm_start_3op_short": "e2_base.gin",
               "warm_start_shortcut": "base_shortcut.gin", "warm_start_b2": "b2_base.gin",
               "warm_start_quickstart": "i_base.gin"}
SEEDS = 5  # the default number of seeds: 0..4
# Finding i's fixes for an INT4 engine: each an arm int4_<key> (config i_int4_<key>.gin).
LOW_PRECISION_FIXES = {"tis": "token TIS", "seq_tis": "sequence TIS", "mis": "MIS",
                       "icepop": "IcePop", "qat": "QAT"}
LONG2SHORT_METHODS = ("shortest_rejection", "dpo", "merge")
LORA_RANKS = (1, 8, 32)  # finding j's


def report_dir() -> str:
  return os.environ.get("LONGRL_FINDINGS_DIR", os.path.join(ROOT, "runs/findings"))


def tiny() -> bool:
  return os.environ.get("LONGRL_FINDINGS_TINY") == "1"


def seeds() -> list[int]:
  """Seeds 0..LONGRL_FINDINGS_SEEDS-1 (default SEEDS)."""
  return list(range(int(os.environ.get("LONGRL_FINDINGS_SEEDS", SEEDS))))


def ci_method() -> str:
  return os.environ.get("LONGRL_FINDINGS_CI", "t")


def _runs_dir() -> str:
  return os.path.join(report_dir(), "runs")


# ----------------------------------------------------------------------------- arms

@dataclasses.dataclass(frozen=True)
class Arm:
  config: str  # a gin file in experiments/configs/findings
  label: str  # its name in plots and tables
  init_from: str = WARM_START  # the arm whose final params it starts from (same seed)


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
    "budget_sync_every_4": Arm("g2_sync_every_4.gin", "budget, weights synced every 4 steps"),
    "long2short_rl": Arm("h_long2short.gin", "long2short RL", init_from="baseline"),
    # Second and third designs (configs a2_*, b2_*, c2_*, d2_*, e2_*, f2_*, f3_*, g2_*).
    "baseline_3op": Arm("c2_baseline.gin", "k1.5, 3 operands", "warm_start_3op"),
    "rest_3op": Arm("c2_rest.gin", "ReST, 3 operands", "warm_start_3op"),
    "uniform_4digit": Arm("d2_uniform.gin", "uniform, 1-4 digits", "warm_start_4digit"),
    "prioritized_4digit": Arm("d2_prioritized.gin", "prioritized, 1-4 digits",
                              "warm_start_4digit"),
    "curriculum_4digit": Arm("d2_curriculum.gin", "curriculum by width, 1-4 digits",
                             "warm_start_4digit"),
    "budget_3op": Arm("f2_budget.gin", "budget 18, 3 operands", "warm_start_3op"),
    "budget_3op_mask_incorrect": Arm("f2_mask_incorrect.gin", "budget 18, -I, 3 operands",
                                     "warm_start_3op"),
    "budget_3op_mask_long_correct": Arm("f2_mask_long_correct.gin",
                                        "budget 18, -L&C, 3 operands", "warm_start_3op"),
    "baseline_3op_short": Arm("e2_baseline.gin", "k1.5, 3 operands, short SFT",
                              "warm_start_3op_short"),
    "baseline_shortcut": Arm("a2_baseline.gin", "k1.5, correctness only, with shortcut",
                             "warm_start_shortcut"),
    "penalty_easy_shortcut": Arm("b2_easy.gin", "length penalty, easy prompts, with shortcut",
                                 "warm_start_b2"),
    "penalty_hard_shortcut": Arm("b2_hard.gin", "length penalty, hard prompts, with shortcut",
                                 "warm_start_b2"),
    "budget_shortcut": Arm("a2_budget.gin", "budget 10, with shortcut", "warm_start_shortcut"),
    "budget_shortcut_mask_incorrect": Arm("f3_mask_incorrect.gin",
                                          "budget 10, -I, with shortcut", "warm_start_shortcut"),
    "budget_shortcut_mask_long_correct": Arm("f3_mask_long_correct.gin",
                                             "budget 10, -L&C, with shortcut",
                                             "warm_start_shortcut"),
    # Finding i: the quickstart's rollouts from an INT4 engine, corrected or not.
    "float32_engine": Arm("i_base.gin", "float32 engine", "warm_start_quickstart"),
    "int4_keep": Arm("i_int4.gin", "INT4 engine, no correction", "warm_start_quickstart"),
    **{f"int4_{c}": Arm(f"i_int4_{c}.gin", f"INT4 engine, {label}", "warm_start_quickstart")
       for c, label in LOW_PRECISION_FIXES.items()},
    # Finding j: the same start and steps with LoRA at three ranks (finding i's float32 arm is
    # its full fine-tuning).
    **{f"lora_r{r}": Arm(f"j_lora_r{r}.gin", f"LoRA rank {r}, lr 1e-3", "warm_start_quickstart")
       for r in LORA_RANKS},
}


def _files(config: str) -> list[str]:
  """`config`'s gin file, and tiny.gin in tiny mode."""
  return [os.path.join(CONFIGS, config)] + ([os.path.join(ROOT, f) for f in TINY]
                                            if tiny() else [])


@contextlib.contextmanager
def _configured(config: str):
  """gin holding `config` (plus the tiny overrides in tiny mode), with the repository root
  as working directory (gin includes are relative to it), until the end: then neither the
  bindings nor the directory outlive it."""
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    gin.clear_config()
    run_lib.load_config(_files(config), TINY_BINDINGS if tiny() else [], run_dir=None)
    yield
  finally:
    gin.clear_config()
    os.chdir(cwd)


def _command(script: str, config: str, bindings) -> list[str]:
  """experiments/`script` with `config` (+ tiny.gin), the tiny bindings and `bindings`."""
  argv = [sys.executable, os.path.join(ROOT, "experiments", script)]
  argv += [a for f in _files(config) for a in ("--gin", f)]
  return argv + [a for b in [*(TINY_BINDINGS if tiny() else []), *bindings]
                 for a in ("--gin_param", b)]


def _arm_dir(name: str, seed: int) -> str:
  return seeds_lib.seed_dir(os.path.join(_runs_dir(), name), seed)


def _name(out_dir: str) -> str:
  return os.path.relpath(out_dir, _runs_dir())


def _arm_job(name: str, seed: int) -> seeds_lib.Job:
  """Arm `name` (or the warm start) on `seed`: run.py in runs/<name>/seed<seed>."""
  out = _arm_dir(name, seed)
  bindings, after = [f"train.seed = {seed}", "Hooks.progress = False"], ()
  if name in WARM_STARTS:
    config, bindings = WARM_STARTS[name], [*bindings, "RLConfig.num_steps = 0"]
    if tiny() and name != WARM_START:  # only finding h's long model needs the 300 SFT steps
      bindings.append("WarmStart.steps = 20")
  else:
    spec = ARMS[name]
    config, start = spec.config, _arm_dir(spec.init_from, seed)
    bindings, after = [*bindings, "train.start = @FromRun()", f"FromRun.path = {start!r}"], (
        _name(start),)
  argv = _command("run.py", config, bindings) + ["--run_dir", out]
  return seeds_lib.Job(_name(out), tuple(argv), out, after)


def _before_rl_dir(name: str, seed: int) -> str:
  return os.path.join(_arm_dir(name, seed), "before_rl")


def _before_rl_job(name: str, seed: int) -> seeds_lib.Job:
  """Arm `name`'s sampled evaluation (its SampledEval, eval_records, seed) of the model it
  starts from, before any RL: what the loop measures at its evaluations, at step 0."""
  spec, out = ARMS[name], _before_rl_dir(name, seed)
  with _configured(spec.config):
    records = gin.query_parameter("Evaluation.records")
  start = _arm_dir(spec.init_from, seed)
  bindings = [f"evaluate.run_dir = {start!r}", "evaluate.task = @Arithmetic()",
              "evaluate.model = @tiny", "evaluate.spec = @SampledEval()",
              f"evaluate.num_records = {records}", f"evaluate.seed = {seed}"]
  argv = _command("eval.py", spec.config, bindings) + ["--out", out]
  return seeds_lib.Job(_name(out), tuple(argv), out, (_name(start),),
                       done_file="report.json", done_key=None, resumes=False)


def _long2short_dir(method: str, seed: int) -> str:
  return seeds_lib.seed_dir(os.path.join(_runs_dir(), "long2short", method), seed)


def _long2short_job(method: str, seed: int) -> seeds_lib.Job:
  """long2short `method` applied to the baseline arm's final model of `seed`."""
  out, long_run = _long2short_dir(method, seed), _arm_dir("baseline", seed)
  argv = _command("long2short.py", "h_long2short.gin",
                  [f"long2short.long_run = {long_run!r}", f"long2short.seed = {seed}",
                   "long2short.progress = False"]) + ["--method", method, "--out_dir", out]
  after = (_name(long_run),)
  if method == "merge":
    short = _long2short_dir("shortest_rejection", seed)
    argv, after = argv + ["--merge_with", short], (*after, _name(short))
  return seeds_lib.Job(_name(out), tuple(argv), out, after, done_key="accuracy",
                       resumes=False)


def _needed_arms(names) -> list[str]:
  """`names`, what they start from, and so on down to the warm start (that first)."""
  order = []
  for name in names:
    chain = [name]
    while chain[-1] not in WARM_STARTS:
      chain.append(ARMS[chain[-1]].init_from)
    order += [n for n in reversed(chain) if n not in order]
  return order


def finding_jobs(key: str, seed_list=None) -> list[seeds_lib.Job]:
  """Every run finding `key` needs on the seeds (default: seeds())."""
  finding, seed_list = FINDINGS[key], seeds() if seed_list is None else seed_list
  jobs = [_arm_job(name, k) for name in _needed_arms(finding.arms) for k in seed_list]
  jobs += [_before_rl_job(name, k) for name in finding.before_rl for k in seed_list]
  if key == "h_long2short":
    jobs += [_long2short_job(m, k) for m in LONG2SHORT_METHODS for k in seed_list]
  return jobs


def ensure(keys) -> None:
  """Run what the findings `keys` need and is not finished yet: LONGRL_FINDINGS_JOBS runs at
  a time (default: as many as the cores allow at LONGRL_FINDINGS_THREADS cores each), seed
  by seed: a config's first seed compiles its programs into the compilation cache (main sets
  one) and its other seeds read them there, instead of two seeds started side by side each
  compiling them (in the smoke test, most of the time of the runs that compile most)."""
  jobs = {}
  for seed in seeds():
    for key in keys:
      for job in finding_jobs(key, [seed]):
        jobs.setdefault(job.name, job)
  _run(list(jobs.values()))


def _run(jobs) -> None:
  """The jobs as subprocesses, `--jobs` at a time; tiny ones (start-up and compile bound) one
  after another in this process."""
  seeds_lib.run_jobs(jobs, parallel=int(os.environ.get("LONGRL_FINDINGS_JOBS", 0)) or None,
                     threads=int(os.environ.get("LONGRL_FINDINGS_THREADS",
                                                seeds_lib.THREADS)), log=_log,
                     in_process=tiny())


def _log(message: str) -> None:
  """Print, and append to REPORT_DIR/progress.log (the notebooks' kernels print out of
  sight while `--all` runs them: `tail -f` that file)."""
  print(message, flush=True)
  os.makedirs(report_dir(), exist_ok=True)
  with open(os.path.join(report_dir(), "progress.log"), "a") as f:
    f.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def minutes(key: str) -> float | None:
  """Minutes the runs of finding `key` took, summed over runs and seeds (their wall times,
  recorded by the runner; None if one of them was not run by it)."""
  times = [seeds_lib.seconds(job.out_dir) for job in finding_jobs(key)]
  return None if None in times else sum(times) / 60


def _read_seeds(run_dir_of: Callable[[int], str], key: str = "rl_accuracy") -> dict[int, dict]:
  """{seed: {"summary": run_dir_of(seed)/summary.json}} over seeds(), each holding `key`."""
  out = {}
  for k in seeds():
    summary = seeds_lib.finished(run_dir_of(k), key=key)
    if summary is None:
      raise FileNotFoundError(f"{run_dir_of(k)} has not finished (findings.ensure runs it)")
    out[k] = {"summary": summary}
  return out


def arm(name: str) -> dict:
  """Arm `name` over the seeds (run first unless finished): {"label", "seeds": {k:
  {"summary": summary.json, "records": metrics.jsonl, and "before_rl": the sampled
  evaluation before RL at the largest budget, where it was measured}}}."""
  _run([_arm_job(n, k) for n in _needed_arms([name]) for k in seeds()])
  runs = _read_seeds(lambda k: _arm_dir(name, k))
  for k, run in runs.items():
    run["records"] = seeds_lib.read_run(_arm_dir(name, k))["records"]
    before = seeds_lib.finished(_before_rl_dir(name, k), "report.json", None)
    if before is not None:
      run["before_rl"] = before["budgets"][max(before["budgets"], key=int)]
  return {"label": ARMS[name].label, "seeds": runs}


def per_seed(data: dict, fn: Callable[[dict], float]) -> dict[int, float]:
  """{seed: fn(that seed's run)} over an arm's seeds."""
  return {k: float(fn(run)) for k, run in data["seeds"].items()}


def first_step_at_or_below(steps, values, level):
  hit = np.flatnonzero(values <= level)
  return int(steps[hit[0]]) if hit.size else int(steps[-1])


def head(values, n: int = 3) -> float:
  return float(np.mean(values[:n]))


def tail(values, fraction: float = 0.2) -> float:
  return float(np.mean(values[-max(1, int(len(values) * fraction)):]))


def _length_start(run) -> float:
  return head(smooth(series(run, "completion_length")[1]))


def _length_end(run) -> float:
  return tail(smooth(series(run, "completion_length")[1]))


def _final_eval(run: dict, key: str = "eval_accuracy") -> float:
  """The mean of a run's evaluations over the second half of its run: one evaluation on 128
  prompts has a standard error of about 0.035 at accuracy 0.8."""
  steps, values = series(run, key)
  return float(np.mean(values[steps > steps[-1] / 2])) if steps[-1] else float(values[-1])


def _start_eval(run: dict, key: str = "eval_accuracy") -> float:
  return float(series(run, key)[1][0])


# ----------------------------------------------------------------------------- results

@dataclasses.dataclass
class Check:
  """One predicted difference: its value per seed, their interval and the verdict."""
  name: str
  prediction: stats.Prediction
  values: dict[int, float]
  interval: stats.Interval
  verdict: str

  def reading(self) -> str:
    """The verdict, saying which of its two reasons a "not reproduced" has."""
    if self.verdict != stats.NOT_REPRODUCED:
      return self.verdict
    p = self.prediction
    opposite = max(p.direction * (v - p.against)
                   for v in (self.interval.low, self.interval.high)) < 0
    reason = "the other way" if opposite else f"within ±{p.margin:g}: no effect"
    return f"{self.verdict} ({reason})"

  def as_dict(self) -> dict:
    return {"name": self.name, "predicted": str(self.prediction),
            "direction": self.prediction.direction, "margin": self.prediction.margin,
            "against": self.prediction.against, "per_seed": self.values,
            **self.interval.as_dict(), "interval": str(self.interval),
            "verdict": self.verdict, "reading": self.reading()}


def check(name: str, values: dict[int, float], prediction: stats.Prediction) -> Check:
  interval = stats.mean_ci(list(values.values()), method=ci_method())
  return Check(name, prediction, dict(values), interval, stats.verdict(interval, prediction))


@dataclasses.dataclass
class Analysis:
  """What a finding's rule reads off its arms."""
  verdict: str
  rule: str  # how the checks make the verdict, in words
  checks: list[Check]
  table: list[dict]  # one row per arm: "arm" its label, other columns {seed: value}
  figure: plt.Figure


@dataclasses.dataclass
class Result:
  key: str
  title: str
  claim: str  # the published result being reproduced, with its source
  analysis: Analysis
  seeds: list[int]
  minutes: float | None = None  # the warm starts and the arms, summed over runs

  @property
  def verdict(self) -> str:
    return self.analysis.verdict

  def as_dict(self) -> dict:
    """What results.json holds: what the report shows, with the per-seed values."""
    return {"key": self.key, "title": self.title, "claim": self.claim,
            "verdict": self.verdict, "rule": self.analysis.rule, "seeds": self.seeds,
            "ci": ci_method(), "checks": [c.as_dict() for c in self.analysis.checks],
            "table": [{c: v if isinstance(v, str) else _interval_dict(v)
                       for c, v in row.items()} for row in self.analysis.table],
            "minutes": self.minutes, "tiny": tiny()}

  def save(self, out_dir: str) -> None:
    """plot.png and results.json (everything the report shows, with the per-seed values)."""
    os.makedirs(out_dir, exist_ok=True)
    self.analysis.figure.savefig(os.path.join(out_dir, "plot.png"), dpi=110,
                                 bbox_inches="tight")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
      json.dump(self.as_dict(), f, indent=2)

  def _repr_markdown_(self) -> str:
    saved = self.as_dict()
    return (f"**{self.title}: {self.verdict}** ({findings_report.seed_list(self.seeds)}). "
            f"{self.analysis.rule}\n\n" + findings_report.checks_table(saved["checks"])
            + "\n\n" + findings_report.arms_table(saved["table"]))


def _interval_dict(values: dict[int, float]) -> dict:
  return {"per_seed": values,
          **stats.mean_ci(list(values.values()), method=ci_method()).as_dict()}


def _row(data: dict, columns: dict[str, Callable[[dict], float]]) -> dict:
  return {"arm": data["label"], **{c: per_seed(data, fn) for c, fn in columns.items()}}


def _curves(arms: dict, panels: list[tuple[str, str]], title: str, window: int = 5,
            marks=()):
  """One panel per (metrics key, axis label), per arm its mean over seeds and the band from
  the lowest to the highest seed; eval_* keys unsmoothed."""
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.3), squeeze=False)
  for ax, (key, label) in zip(axes[0], panels):
    evaluation = key.startswith("eval_")
    for data in arms.values():
      compare.draw(ax, data["seeds"], key, label=data["label"],
                   window=1 if evaluation else window, marker="o" if evaluation else None,
                   markersize=3)
    for step in marks:
      ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  n = len(next(iter(arms.values()))["seeds"])
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"{title} (mean over {n} seed{'s' * (n > 1)}"
               + ("; band: lowest to highest seed)" if n > 1 else ")"), fontsize=10)
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


ALL_CHECKS = ("Reproduced when every check is, not reproduced when none is, partially "
              "reproduced between; too wide to tell while any check is.")

# Margins: one held-out greedy evaluation on 128 prompts has a standard error of about
# 0.035, so accuracy differences under ACCURACY_MARGIN count as none; length differences
# under LENGTH_MARGIN tokens (a filler step is 4) likewise.
ACCURACY_MARGIN = 0.03
LENGTH_MARGIN = 1.0


# ----------------------------------------------------------------------------- the findings

def two_stages(arms) -> Analysis:
  """a. Under a length budget: length falls first, then accuracy recovers, both measured
  against the correctness-only arm on the same seeds (RL raises the correctness-only arm's
  accuracy too, so a recovery against the start would count that)."""
  budget, base = arms["budget"], arms["baseline"]

  def adapted(run) -> int:  # the step by which 90% of the length fall is done
    steps, length = series(run, "completion_length")
    length_s = smooth(length)
    start, end = head(length_s), tail(length_s)
    return first_step_at_or_below(steps, length_s, end + 0.1 * (start - end))

  def recovery(k) -> float:  # the accuracy gap to baseline: 2nd half minus after the fall
    steps, ours = series(budget["seeds"][k], "eval_accuracy")
    base_steps, theirs = series(base["seeds"][k], "eval_accuracy")
    common = np.intersect1d(steps, base_steps)
    gap = ours[np.isin(steps, common)] - theirs[np.isin(base_steps, common)]
    at = min(np.searchsorted(common, adapted(budget["seeds"][k])), len(common) - 1)
    return float(np.mean(gap[common > common[-1] / 2]) - gap[at])

  checks = [
      check("mean length, last 20%: budget - correctness-only (tokens)",
            stats.paired_differences(per_seed(budget, _length_end), per_seed(base, _length_end)),
            stats.Prediction(-1, LENGTH_MARGIN)),
      check("held-out accuracy gap to correctness-only: 2nd half minus at the end of the "
            "length fall", {k: recovery(k) for k in budget["seeds"]},
            stats.Prediction(+1, ACCURACY_MARGIN))]
  table = [_row(d, {"length start": _length_start, "length end": _length_end,
                    "90% of the length fall by step": adapted,
                    "train accuracy end": lambda r: tail(series(r, "accuracy")[1]),
                    "reward end": lambda r: tail(series(r, "reward")[1]),
                    "held-out acc. start": _start_eval,
                    "held-out acc., 2nd half": _final_eval}) for d in arms.values()]
  marks = [float(np.mean(list(per_seed(budget, adapted).values())))]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("reward", "reward (budget arm: correct within budget)"),
                       ("eval_accuracy", "held-out greedy accuracy")],
                "a. length budget: length first, then accuracy", marks=marks)
  return Analysis(stats.all_of(c.verdict for c in checks),
                  "The budget arm must end shorter than the correctness-only arm, and its "
                  "held-out accuracy relative to that arm must rise after its length fell "
                  "(the dotted line: the mean step by which 90% of the fall is done). "
                  + ALL_CHECKS, checks, table, fig)


def easy_vs_hard(arms) -> Analysis:
  """b. Length penalty on hard prompts only collapses; on easy prompts it stays stable."""
  easy, hard = arms["penalty_easy"], arms["penalty_hard"]
  spike = lambda run: (float(np.max(smooth(series(run, "entropy")[1])))
                       / head(series(run, "entropy")[1]))
  against_easy = lambda fn: stats.paired_differences(per_seed(hard, fn), per_seed(easy, fn))
  checks = [
      check("held-out accuracy, 2nd half: hard - easy",
            against_easy(_final_eval), stats.Prediction(-1, ACCURACY_MARGIN)),
      check("entropy peak / start: hard - easy", against_easy(spike),
            stats.Prediction(+1, 0.1)),
      check("mean length, last 20%: hard - easy (tokens)", against_easy(_length_end),
            stats.Prediction(-1, LENGTH_MARGIN)),
      check("easy prompts: held-out accuracy, 2nd half minus start (falls by under 0.05)",
            per_seed(easy, lambda r: _final_eval(r) - _start_eval(r)),
            stats.Prediction(+1, against=-0.05))]
  table = [_row(d, {"length start": _length_start,
                    "length end": _length_end,
                    "entropy start": lambda r: head(series(r, "entropy")[1]),
                    "entropy peak / start": spike, "held-out acc. start": _start_eval,
                    "held-out acc., 2nd half": _final_eval}) for d in arms.values()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("entropy", "entropy"), ("eval_accuracy", "held-out greedy accuracy")],
                "b. length penalty on easy vs hard prompts")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  "Hard prompts only must collapse against easy prompts only on the same "
                  "seeds (accuracy lower, entropy spiking, length crashing) while the easy "
                  "arm keeps its accuracy. " + ALL_CHECKS, checks, table, fig)


def _accuracy_table(arms):
  return [_row(d, {"held-out acc. start": _start_eval, "held-out acc., 2nd half": _final_eval,
                   "train acc. end": lambda r: tail(series(r, "accuracy")[1]),
                   "length end": lambda r: tail(series(r, "completion_length")[1])})
          for d in arms.values()]


def negative_gradients(arms) -> Analysis:
  """c. k1.5 (uses failed samples) vs ReST (successes only) at equal samples."""
  checks = [check("held-out accuracy, 2nd half: k1.5 - ReST", stats.paired_differences(
      per_seed(arms["baseline"], _final_eval), per_seed(arms["rest"], _final_eval)),
                  stats.Prediction(+1, ACCURACY_MARGIN))]
  fig = _curves(arms, [("eval_accuracy", "held-out greedy accuracy"),
                       ("accuracy", "train accuracy"), ("entropy", "entropy")],
                "c. negative gradients: k1.5 vs ReST")
  return Analysis(checks[0].verdict, "k1.5 must beat ReST on held-out accuracy over the "
                  "second half of the run (the mean of its evaluations), seed by seed.",
                  checks, _accuracy_table(arms), fig)


def samplers(arms) -> Analysis:
  """d. Curriculum and prioritized sampling vs uniform at equal steps."""
  uniform = per_seed(arms["baseline"], _final_eval)
  checks = [check(f"held-out accuracy, 2nd half: {name} - uniform",
                  stats.paired_differences(per_seed(arms[name], _final_eval), uniform),
                  stats.Prediction(+1, ACCURACY_MARGIN))
            for name in ("prioritized", "curriculum")]
  fig = _curves(arms, [("eval_accuracy", "held-out greedy accuracy"),
                       ("accuracy", "train accuracy")], "d. prompt sampling at equal steps")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  "Each sampler must beat uniform sampling on held-out accuracy over the "
                  "second half, seed by seed. " + ALL_CHECKS, checks, _accuracy_table(arms), fig)


# On two operands pass@16 starts at about 0.95 (a ceiling: it can hardly rise, so "flat" would
# hold trivially); pass@4 starts at about 0.87, with room to move either way.
COVERAGE_K = 4
COVERAGE_RISE = 0.02  # the largest rise of pass@k that still counts as flat


def coverage(arms, k: int | None = COVERAGE_K) -> Analysis:
  """e. mean@n rises under RL while pass@k (None: the largest k logged) stays flat or falls,
  both from the model before RL (the warm start, sampled alike) to the second half of RL."""
  data = arms["baseline"]
  run0 = next(iter(data["seeds"].values()))
  ks = sorted({int(key.split("@")[1]) for r in run0["records"] for key in r
               if key.startswith("eval_pass@")})
  k = ks[-1] if k is None else k
  if k not in ks:
    raise ValueError(f"finding e reads pass@{k}; the baseline arm logged pass@k for "
                     f"k in {ks} (SampledEval.ks)")
  n = ks[-1]
  rows = {"before RL": lambda run, key: run["before_rl"][key],
          "RL, 2nd half": lambda run, key: _final_eval(run, f"eval_{key}")}
  keys = [*(f"pass@{j}" for j in ks), f"mean@{n}", f"maj@{n}"]
  change = lambda key: per_seed(data, lambda r: rows["RL, 2nd half"](r, key)
                                - rows["before RL"](r, key))
  checks = [check(f"mean@{n}: RL 2nd half minus before RL", change(f"mean@{n}"),
                  stats.Prediction(+1, 0.02)),
            check(f"pass@{k}: RL 2nd half minus before RL (flat or falls: rises by "
                  f"under {COVERAGE_RISE})", change(f"pass@{k}"),
                  stats.Prediction(-1, against=COVERAGE_RISE))]
  table = [{"arm": f"{data['label']}, {when}",
            **{key: per_seed(data, lambda r, key=key: fn(r, key)) for key in keys}}
           for when, fn in rows.items()]
  fig, ax = plt.subplots(figsize=(5.4, 3.6))
  for key in [*(f"pass@{j}" for j in ks), f"mean@{n}"]:
    compare.draw(ax, data["seeds"], f"eval_{key}", label=key, marker="o", markersize=3,
                 linestyle="--" if key.startswith("mean") else "-")
    before = np.array(list(per_seed(data, lambda r: r["before_rl"][key]).values()))
    ax.errorbar([0], [before.mean()], yerr=[[before.mean() - before.min()],
                                            [before.max() - before.mean()]],
                fmt="s", color=ax.lines[-1].get_color(), markersize=4, capsize=2)
  _label(fig, ax, "RL step (step 0: before RL)", "held-out, sampled at T=1",
         f"e. coverage (pass@k) vs sharpening (mean@{n}), {len(data['seeds'])} seed(s)\n"
         "mean; band and bars: lowest to highest seed")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  f"From before RL to the second half of RL, mean@{n} must rise and "
                  f"pass@{k} must not rise by {COVERAGE_RISE} or more"
                  + (f" (pass@{n} starts near its ceiling). " if n > k else ". ")
                  + ALL_CHECKS, checks, table, fig)


def masking(arms) -> Analysis:
  """f. -I drives the policy to short nonsense; -L&C keeps longer reasoning."""
  base, minus_i, minus_lc = (arms["budget"], arms["budget_mask_incorrect"],
                             arms["budget_mask_long_correct"])
  length = lambda run: tail(series(run, "completion_length")[1])
  against_base = lambda data, fn: stats.paired_differences(per_seed(data, fn),
                                                           per_seed(base, fn))
  checks = [check("mean length, last 20%: -I - budget (tokens)", against_base(minus_i, length),
                  stats.Prediction(-1, LENGTH_MARGIN)),
            check("held-out accuracy, 2nd half: -I - budget", against_base(minus_i, _final_eval),
                  stats.Prediction(-1, ACCURACY_MARGIN)),
            check("mean length, last 20%: -L&C - budget (tokens)",
                  against_base(minus_lc, length), stats.Prediction(+1, LENGTH_MARGIN))]
  table = [_row(d, {"length end": length, "held-out acc., 2nd half": _final_eval,
                    "well-formed end": lambda r: tail(series(r, "well_formed")[1])})
           for d in arms.values()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("eval_accuracy", "held-out greedy accuracy"),
                       ("well_formed", "well-formed fraction")],
                "f. masking instead of zero reward")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  "Against the budget arm on the same seeds, -I must end shorter and less "
                  "accurate (short nonsense) and -L&C longer. " + ALL_CHECKS, checks, table, fig)


def staleness(arms, stale: str = "With 4 updates per batch") -> Analysis:
  """g. Stale (off-policy) updates speed up length adaptation but raise entropy later.
  `stale` says how the stale arm is stale, for the rule."""
  def half_fall(run) -> int:  # the step at which the smoothed length has fallen half way
    steps, length = series(run, "completion_length")
    length_s = smooth(length)
    start, end = head(length_s), tail(length_s)
    return first_step_at_or_below(steps, length_s, start - 0.5 * (start - end))

  late_entropy = lambda run: tail(series(run, "entropy")[1], 0.25)
  on, off = arms["budget"], arms["budget_stale"]
  checks = [check("step at half the length fall: stale - on-policy",
                  stats.paired_differences(per_seed(off, half_fall), per_seed(on, half_fall)),
                  stats.Prediction(-1, 1.0)),
            check("entropy, last quarter: stale - on-policy",
                  stats.paired_differences(per_seed(off, late_entropy),
                                           per_seed(on, late_entropy)),
                  stats.Prediction(+1, 0.01))]
  table = [_row(d, {"length start": _length_start,
                    "length end": _length_end, "step at half the fall": half_fall,
                    "entropy, last quarter": late_entropy,
                    "held-out acc., 2nd half": _final_eval}) for d in arms.values()]
  fig = _curves(arms, [("completion_length", "mean completion length"),
                       ("entropy", "entropy"), ("eval_accuracy", "held-out greedy accuracy")],
                "g. off-policy staleness")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  f"{stale} the length must fall half way at an earlier step "
                  "(by more than 1) and entropy over the last quarter must be higher (by more "
                  "than 0.01 nats) than on-policy, seed by seed. " + ALL_CHECKS,
                  checks, table, fig)


def _run_mean(key: str) -> Callable[[dict], float]:
  """A run's mean of metrics `key` over its RL steps."""
  return lambda run: float(np.mean(series(run, key)[1]))


# A k3 estimate of KL(engine || trainer) per token under this counts as no mismatch: float32
# engine and trainer differ by summation order alone (~1e-7).
KL_MARGIN = 1e-3


def low_precision(arms) -> Analysis:
  """i. Rollouts from an INT4 engine: uncorrected they cost held-out accuracy against a float32
  engine; each correction recovers some, and QAT removes the mismatch."""
  reference, uncorrected = arms["float32_engine"], arms["int4_keep"]
  against = lambda data, fn, base=uncorrected: stats.paired_differences(per_seed(data, fn),
                                                                        per_seed(base, fn))
  kl = _run_mean("engine_kl_k3")
  checks = [check("held-out accuracy, 2nd half: INT4 engine, no correction - float32 engine",
                  against(uncorrected, _final_eval, reference),
                  stats.Prediction(-1, ACCURACY_MARGIN))]
  checks += [check(f"held-out accuracy, 2nd half: INT4 engine with {label} - without",
                   against(arms[f"int4_{fix}"], _final_eval),
                   stats.Prediction(+1, ACCURACY_MARGIN))
             for fix, label in LOW_PRECISION_FIXES.items()]
  checks.append(check("KL(engine || trainer) per token, mean over steps: QAT - no correction",
                      against(arms["int4_qat"], kl), stats.Prediction(-1, KL_MARGIN)))
  table = [_row(d, {"held-out acc. start": _start_eval, "held-out acc., 2nd half": _final_eval,
                    "KL(engine || trainer), k3": kl,
                    "ratio p01": _run_mean("engine_ratio_p01"),
                    "ratio p99": _run_mean("engine_ratio_p99"),
                    "IcePop would mask": _run_mean("would_mask_icepop"),
                    "seq. MIS would mask": _run_mean("would_mask_seq_mis")})
           for d in arms.values()]
  fig = _curves(arms, [("eval_accuracy", "held-out greedy accuracy (as served)"),
                       ("accuracy", "train accuracy"),
                       ("engine_kl_k3", "KL(engine || trainer) per token (k3)")],
                "i. INT4 rollouts, float32 trainer")
  fig.axes[2].set_yscale("log")  # float32 and QAT at ~1e-8: summation order alone
  return Analysis(stats.all_of(c.verdict for c in checks),
                  "Against the float32 engine on the same seeds the uncorrected INT4 engine "
                  "must lose held-out accuracy (measured on the engine that generated, as "
                  "served); against the uncorrected INT4 engine each correction and QAT must "
                  "gain it, and QAT must cut the mismatch. " + ALL_CHECKS, checks, table, fig)


def lora_ranks(arms) -> Analysis:
  """j. LoRA at ranks 1, 8 and 32 with 10x the learning rate keeps up with full fine-tuning:
  none ends more than ACCURACY_MARGIN below it in held-out accuracy."""
  full = {**arms["float32_engine"], "label": "full fine-tuning, lr 1e-4"}
  adapted = {f"lora_r{r}": arms[f"lora_r{r}"] for r in LORA_RANKS}
  checks = [check(f"held-out accuracy, 2nd half: LoRA rank {r} - full fine-tuning",
                  stats.paired_differences(per_seed(adapted[f"lora_r{r}"], _final_eval),
                                           per_seed(full, _final_eval)),
                  stats.Prediction(+1, 0.0, against=-ACCURACY_MARGIN))
            for r in LORA_RANKS]
  table = [_row(d, {"held-out acc. start": _start_eval, "held-out acc., 2nd half": _final_eval,
                    "train acc., mean": _run_mean("accuracy"),
                    "grad norm, mean": _run_mean("grad_norm")})
           for d in (full, *adapted.values())]
  fig = _curves({"full": full, **adapted},
                [("eval_accuracy", "held-out greedy accuracy"), ("accuracy", "train accuracy"),
                 ("entropy", "entropy per token")], "j. LoRA ranks against full fine-tuning")
  return Analysis(stats.all_of(c.verdict for c in checks),
                  f"On the same seeds and warm start, each rank's held-out accuracy over the "
                  f"second half must stay above full fine-tuning's less {ACCURACY_MARGIN:g} "
                  "(a bound, not an effect: LoRA is predicted to keep up, not to win). "
                  + ALL_CHECKS, checks, table, fig)


def _evaluate_policy(run_dir: str, seed: int) -> dict:
  """rl.long2short.evaluate of `run_dir`'s latest params under h_long2short.gin's task and
  sizes with `seed` (what rl.long2short.run measures of its models), cached in
  run_dir/long2short_eval.json."""
  path = os.path.join(run_dir, "long2short_eval.json")
  if not os.path.exists(path):
    with _configured("h_long2short.gin"):
      task = gin.query_parameter("long2short.task").scoped_configurable_fn()
      tokenizer = CharTokenizer()
      cfg = gin.query_parameter("long2short.model").scoped_configurable_fn(
          tokenizer.vocab_size)
      result = long2short_lib.evaluate(
          long2short_lib.load(run_dir, cfg), cfg, task, tokenizer,
          num_records=gin.query_parameter("Long2ShortConfig.eval_records"),
          max_new_tokens=gin.query_parameter("Long2ShortConfig.max_new_tokens"), seed=seed)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  return json.load(open(path))


def long2short_models(arms) -> dict:
  """Finding h's models measured alike, in the shape of arms: {model: {"label", "seeds": {k:
  {"summary": rl.long2short.evaluate's dict}}}}. The methods' summaries hold that
  measurement of their model and of the long one (long_*); long2short RL is measured here."""
  methods = {m: _read_seeds(lambda k, m=m: _long2short_dir(m, k), key="accuracy")
             for m in LONG2SHORT_METHODS}
  long = {k: {"summary": {key[len("long_"):]: v for key, v in run["summary"].items()
                          if key.startswith("long_") and key != "long_run"}}
          for k, run in methods["shortest_rejection"].items()}
  rl = {k: {"summary": _evaluate_policy(_arm_dir("long2short_rl", k), k)}
        for k in arms["long2short_rl"]["seeds"]}
  models = {"long model": long, **{m.replace("_", " "): runs for m, runs in methods.items()},
            "long2short RL": rl}
  return {name: {"label": name, "seeds": runs} for name, runs in models.items()}


RELATIVE_CUT = 0.05  # a change in mean tokens under 5% counts as none


def long2short_methods(models) -> Analysis:
  """h. long2short: every method shortens; long2short RL gives the best accuracy for its
  length (no model is both shorter and more accurate)."""
  length = lambda name: per_seed(models[name], lambda r: r["summary"]["sampled_length"])
  accuracy = lambda name: per_seed(models[name], lambda r: r["summary"]["sampled_accuracy"])
  long_length = length("long model")
  shortened = [n for n in models if n != "long model"]
  cuts = [check(f"{n}: mean tokens / long model's - 1",
                {k: v / long_length[k] - 1 for k, v in length(n).items()},
                stats.Prediction(-1, RELATIVE_CUT)) for n in shortened]
  rl = "long2short RL"
  others = [n for n in shortened if n != rl]
  beats = [(check(f"long2short RL - {n}: mean tokens", stats.paired_differences(
                length(rl), length(n)), stats.Prediction(-1, LENGTH_MARGIN)),
            check(f"long2short RL - {n}: accuracy", stats.paired_differences(
                accuracy(rl), accuracy(n)), stats.Prediction(+1, ACCURACY_MARGIN)))
           for n in others]
  verdict = stats.all_of([c.verdict for c in cuts]
                         + [stats.either(c.verdict for c in pair) for pair in beats])
  table = [_row(d, {"sampled acc.": lambda r: r["summary"]["sampled_accuracy"],
                    "sampled mean tokens": lambda r: r["summary"]["sampled_length"],
                    "greedy acc.": lambda r: r["summary"]["accuracy"],
                    "greedy tokens": lambda r: r["summary"]["length"]})
           for d in models.values()]
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for name in models:
    x, y = np.array(list(length(name).values())), np.array(list(accuracy(name).values()))
    ax.errorbar(x.mean(), y.mean(), xerr=[[x.mean() - x.min()], [x.max() - x.mean()]],
                yerr=[[y.mean() - y.min()], [y.max() - y.mean()]], label=name, capsize=2,
                fmt="*" if name == "long model" else "o", markersize=7)
  _label(fig, ax, "mean completion tokens (held-out, sampled)",
         "held-out accuracy (sampled, T=1)",
         f"h. long2short: accuracy vs tokens (k1.5 Fig. 7), {len(long_length)} seed(s)\n"
         "mean; bars: lowest to highest seed")
  return Analysis(verdict, "Every method must cut the long model's sampled mean tokens by "
                  f"more than {RELATIVE_CUT:.0%}, and against each other method long2short "
                  "RL must be shorter or more accurate (not dominated), seed by seed. "
                  "Reproduced when all of that holds.", [*cuts, *(c for p in beats for c in p)],
                  table, fig)


@dataclasses.dataclass(frozen=True)
class Finding:
  key: str  # also the notebook's name
  title: str
  claim: str
  arms: tuple[str, ...]
  analyse: Callable[[dict], Analysis]
  before_rl: tuple[str, ...] = ()  # arms whose starting model is sampled before RL
  load: Callable[[dict], dict] | None = None  # arms -> what analyse reads (default: arms)
  # A second design's arms under the names its analysis reads (e.g. {"rest": "rest_3op"}).
  roles: Mapping[str, str] = dataclasses.field(default_factory=dict)


CLAIM_A = ("Under a length budget, training first shortens responses (length adaptation), "
           "then accuracy within the shorter budget recovers (reasoning refinement) "
           "[The Art of Efficient Reasoning, arXiv 2602.20945, sec. 3].")
CLAIM_B = ("Training with a length penalty on hard prompts only collapses (length crashes, "
           "entropy spikes, accuracy falls); on easy prompts it stays stable and generalises "
           "[arXiv 2602.20945].")
CLAIM_C = ("At equal samples the k1.5 objective, which also learns from failed samples, beats "
           "ReST (positive-only fine-tuning) [Kimi k1.5, arXiv 2501.12599, sec. 3.5].")
CLAIM_D = ("Curriculum sampling (easy first) and prioritized sampling (p ~ 1 - success rate) "
           "both beat uniform sampling at equal steps [Kimi k1.5, sec. 2.3.4 and 3.5].")
CLAIM_E = ("RL sharpens the distribution: mean@k (pass@1) rises while pass@k at large k "
           "stays flat or falls [Yue et al. 2025, arXiv 2504.13837].")
CLAIM_F = ("Masking incorrect answers out of the loss (\"-I\") drives the policy to short "
           "nonsense; masking long correct ones (\"-L&C\") keeps longer reasoning "
           "[arXiv 2602.20945].")
CLAIM_I = ("An engine on low-precision weights makes rollouts the trainer did not: uncorrected, "
           "the mismatch costs accuracy; importance-sampling corrections (token TIS, Yao et al. "
           "2025; sequence TIS and MIS, Liu et al. 2025, \"When speed kills stability\"; "
           "IcePop, Ring-1T, arXiv 2510.18855) recover it, and quantization-aware training "
           "removes the mismatch (Kimi K2 Thinking's INT4 rollouts).")
CLAIM_J = ("LoRA matches full fine-tuning in policy-gradient RL even at rank 1, when it adapts "
           "every layer and its learning rate is about 10x full fine-tuning's (Thinking "
           "Machines, \"LoRA Without Regret\", 2025); a PEFT-for-RLVR study on R1-distilled "
           "models finds rank 1 too small for reasoning.")
CLAIM_G = ("Mildly stale (off-policy) updates speed up the length-adaptation phase but raise "
           "entropy later [arXiv 2602.20945].")

FINDINGS = {f.key: f for f in [
    Finding("a_two_stages", "a. Length penalty's two stages", CLAIM_A, ("budget", "baseline"),
            two_stages),
    Finding("a2_two_stages_shortcut", "a2. Length penalty's two stages, second design: a "
            "short mode that costs accuracy", CLAIM_A + " Here the demonstrations answer directly "
            "(bare, less accurate) 30% of the time, the budget is met only by those bare "
            "answers, and there is no demonstrator mistake to unlearn.",
            ("budget_shortcut", "baseline_shortcut"), two_stages,
            roles={"budget": "budget_shortcut", "baseline": "baseline_shortcut"}),
    Finding("b_easy_vs_hard", "b. Easy vs hard prompts under a length penalty", CLAIM_B,
            ("penalty_easy", "penalty_hard"), easy_vs_hard),
    Finding("b2_easy_vs_hard_shortcut", "b2. Easy vs hard prompts under a length penalty, "
            "second design: shortening costs accuracy", CLAIM_B + " Here the demonstrations "
            "answer directly (bare, less accurate) 30% of the time and there is no filler, so "
            "the penalty can only shorten by giving up the column steps.",
            ("penalty_easy_shortcut", "penalty_hard_shortcut"), easy_vs_hard,
            roles={"penalty_easy": "penalty_easy_shortcut",
                   "penalty_hard": "penalty_hard_shortcut"}),
    Finding("c_negative_gradients", "c. Negative gradients: k1.5 vs ReST",
            CLAIM_C, ("baseline", "rest"), negative_gradients),
    # a2, b2, c2, d2, e2, f2, f3, g2: later designs, kept beside the first, giving the claim a
    # fair chance.
    Finding("c2_negative_gradients_harder", "c2. Negative gradients, second design: a harder "
            "task", CLAIM_C + " Here on sums of three numbers (more failed samples).",
            ("baseline_3op", "rest_3op"), negative_gradients,
            roles={"baseline": "baseline_3op", "rest": "rest_3op"}),
    Finding("d_sampling", "d. Curriculum and prioritized sampling",
            CLAIM_D, ("baseline", "prioritized", "curriculum"), samplers),
    Finding("d2_sampling_spread", "d2. Curriculum and prioritized sampling, second design: a "
            "pool with a spread of difficulty", CLAIM_D + " Here on a pool of 512 "
            "sums of 1- to 4-digit numbers, each drawn about 7 times.",
            ("uniform_4digit", "prioritized_4digit", "curriculum_4digit"), samplers,
            roles={"baseline": "uniform_4digit", "prioritized": "prioritized_4digit",
                   "curriculum": "curriculum_4digit"}),
    Finding("e_coverage", "e. Coverage vs sharpening", CLAIM_E,
            ("baseline",), coverage, before_rl=("baseline",)),
    Finding("e2_coverage_harder", "e2. Coverage vs sharpening, second design: a harder task",
            CLAIM_E + " Here from a weak warm start on sums of three numbers (pass@16 about "
            "0.7 before RL), read at the largest k (16).",
            ("baseline_3op_short",), functools.partial(coverage, k=None),
            before_rl=("baseline_3op_short",), roles={"baseline": "baseline_3op_short"}),
    Finding("f_masking", "f. Masking incorrect vs long-correct completions",
            CLAIM_F, ("budget", "budget_mask_incorrect", "budget_mask_long_correct"), masking),
    Finding("f2_masking_long_answers", "f2. Masking, second design: correct answers that "
            "cannot be shortened", CLAIM_F + " Here with a budget under most "
            "correct answers' length on sums of three numbers without filler.",
            ("budget_3op", "budget_3op_mask_incorrect", "budget_3op_mask_long_correct"),
            masking, roles={"budget": "budget_3op",
                            "budget_mask_incorrect": "budget_3op_mask_incorrect",
                            "budget_mask_long_correct": "budget_3op_mask_long_correct"}),
    Finding("f3_masking_shortcut", "f3. Masking, third design: a short mode that costs "
            "accuracy", CLAIM_F + " Here with a2's budget of 10 tokens, which only the bare "
            "answers of base_shortcut.gin meet.",
            ("budget_shortcut", "budget_shortcut_mask_incorrect",
             "budget_shortcut_mask_long_correct"), masking,
            roles={"budget": "budget_shortcut",
                   "budget_mask_incorrect": "budget_shortcut_mask_incorrect",
                   "budget_mask_long_correct": "budget_shortcut_mask_long_correct"}),
    Finding("g_staleness", "g. Off-policy staleness", CLAIM_G, ("budget", "budget_stale"),
            staleness),
    Finding("g2_staleness_sync", "g2. Off-policy staleness, second design: stale weights, "
            "not extra updates", CLAIM_G + " Here the engine's weights are synced every 4th "
            "step, one update per step.", ("budget", "budget_sync_every_4"),
            functools.partial(staleness, stale="With weights synced every 4th step"),
            roles={"budget": "budget", "budget_stale": "budget_sync_every_4"}),
    Finding("h_long2short", "h. long2short",
            "From a long-CoT model, shortest-rejection SFT, DPO, weight merging and "
            "long2short RL all cut tokens; long2short RL gives the best accuracy for its "
            "length [Kimi k1.5, sec. 2.4 and Fig. 7].",
            ("baseline", "long2short_rl"), long2short_methods, load=long2short_models),
    Finding("i_int4_rollouts", "i. INT4 rollouts and the correction menu", CLAIM_I,
            ("float32_engine", "int4_keep", *(f"int4_{fix}" for fix in LOW_PRECISION_FIXES)),
            low_precision),
    Finding("j_lora_ranks", "j. LoRA ranks against full fine-tuning", CLAIM_J,
            ("float32_engine", *(f"lora_r{r}" for r in LORA_RANKS)), lora_ranks),
]}


def _retitle(fig, name: str) -> None:
  """Titles of `fig` (its suptitle or its axes') that begin with a finding's letter ("c. ...")
  begin with `name` instead ("c2. ...")."""
  rename = lambda title: name + title[title.index("."):]
  if fig.get_suptitle():
    fig.suptitle(rename(fig.get_suptitle()))
  for ax in fig.axes:
    if ax.get_title().split(".")[0].isalpha():
      ax.set_title(rename(ax.get_title()), fontsize=ax.title.get_fontsize())


def run(key: str) -> Result:
  """Run what finding `key` needs unless finished, analyse it over the seeds, save
  REPORT_DIR/<key>/ (plot.png, results.json)."""
  finding = FINDINGS[key]
  ensure([key])
  arms = {name: arm(name) for name in finding.arms}
  arms = {role: arms[name] for role, name in finding.roles.items()} if finding.roles else arms
  analysis = finding.analyse(finding.load(arms) if finding.load else arms)
  if finding.roles:  # a second design's plot goes by its own name (c2, not c)
    _retitle(analysis.figure, key.split("_")[0])
  result = Result(key, finding.title, finding.claim, analysis, seeds(), minutes(key))
  result.save(os.path.join(report_dir(), key))
  return result


# ----------------------------------------------------------------------------- headless

def execute_notebooks(keys, out_dir: str, *, timeout: int = 3600, parallel: int = 2) -> None:
  """Execute the findings' notebooks with nbclient (they read the LONGRL_FINDINGS_*
  variables), `parallel` kernels at a time (their runs are done: they read and plot), and
  write them, executed, to out_dir."""
  import asyncio

  import nbformat
  from nbclient import NotebookClient

  async def execute(key: str, kernels: asyncio.Semaphore) -> None:
    async with kernels:
      path = os.path.join(NOTEBOOKS, f"{key}.ipynb")
      nb = nbformat.read(path, as_version=4)
      started = time.perf_counter()
      print(f"[{key}] executing {os.path.relpath(path, ROOT)} (progress: "
            f"{os.path.join(out_dir, 'progress.log')})", flush=True)
      await NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": NOTEBOOKS}}).async_execute()
      nbformat.write(nb, os.path.join(out_dir, f"{key}.ipynb"))
      verdict = json.load(open(os.path.join(out_dir, key, "results.json")))["verdict"]
      print(f"[{key}] {verdict} ({time.perf_counter() - started:.0f} s)", flush=True)

  async def execute_all() -> None:
    kernels = asyncio.Semaphore(parallel)
    await asyncio.gather(*(execute(key, kernels) for key in keys))

  asyncio.run(execute_all())


def write_report(keys, out_dir: str) -> str:
  """REPORT_DIR/report.md from these findings' REPORT_DIR/<key>/results.json, in this order."""
  results = [json.load(open(os.path.join(out_dir, key, "results.json"))) for key in keys]
  path = os.path.join(out_dir, "report.md")
  with open(path, "w") as f:
    f.write(findings_report.report(results))
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("keys", nargs="*",
                      help="findings by letter (a..j, a2, b2, c2, d2, e2, f2, f3, g2) or name")
  parser.add_argument("--all", action="store_true", help="every finding")
  parser.add_argument("--seeds", type=int, default=SEEDS,
                      help=f"seeds 0..SEEDS-1 per arm (default {SEEDS})")
  parser.add_argument("--jobs", type=int, default=None,
                      help="runs at once (default: cores / threads)")
  parser.add_argument("--threads", type=int, default=seeds_lib.THREADS,
                      help=f"cores per run (default {seeds_lib.THREADS})")
  parser.add_argument("--ci", choices=stats.METHODS, default="t",
                      help="interval over seeds: t (default) or bootstrap")
  parser.add_argument("--tiny", action="store_true", help="a smoke test of seconds each")
  parser.add_argument("--report_dir", default=None, help="default: runs/findings")
  args = parser.parse_args(argv)
  by_letter = {key.split("_")[0]: key for key in FINDINGS}
  keys = list(FINDINGS) if args.all else [by_letter.get(k, k) for k in args.keys]
  unknown = [k for k in keys if k not in FINDINGS]
  if not keys or unknown:
    parser.error(f"unknown finding(s) {unknown}; valid: {', '.join(FINDINGS)} (or their "
                 "letters: a..j, a2, c2, ...), or --all" if unknown else "name findings (a..j, "
                 "a2, b2, c2, d2, e2, f2, f3, g2) or give --all")
  if args.seeds < 1:
    parser.error(f"--seeds must be at least 1, got {args.seeds}")
  os.environ["LONGRL_FINDINGS_DIR"] = os.path.abspath(args.report_dir or report_dir())
  os.environ["LONGRL_FINDINGS_SEEDS"] = str(args.seeds)
  os.environ["LONGRL_FINDINGS_CI"] = args.ci
  os.environ["LONGRL_FINDINGS_THREADS"] = str(args.threads)
  if args.jobs:
    os.environ["LONGRL_FINDINGS_JOBS"] = str(args.jobs)
  if args.tiny:
    os.environ["LONGRL_FINDINGS_TINY"] = "1"
  out_dir = report_dir()
  os.makedirs(out_dir, exist_ok=True)
  # The runs compile the same small programs again and again: share them on disk.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(out_dir, ".jax_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  # This process's JAX read the environment when it was imported: runs made in it (--tiny)
  # share the cache too.
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  ensure(keys)  # every run first, in parallel
  execute_notebooks(keys, out_dir)  # then the analyses
  print(f"report: {write_report(keys, out_dir)}")


if __name__ == "__main__":
  main()
