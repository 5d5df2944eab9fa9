"""Reasoning effort (low / high / max): budgets fixed from the warm start, and a warm start
that reads the level.

  python experiments/effort_demo.py [--variant VARIANT] [--seeds S]
      [--out_dir runs/effort2] [--docs docs/effort]

The first try (experiments/configs/effort.gin, docs/effort/first_try.json) estimated each
(problem, level) budget from the record's first RL group; with 20,000 problems x 3 levels
nearly every record is first drawn late, so its budget followed the shrinking policy (a
ratchet), and low = 0.5 x median was shorter than a correct answer. Here, as in Kimi K3:

1. SFT warm start on sums of three 2-digit numbers with exact demonstrations (sloppy = 0),
   the model and SFT of effort.gin, on the task's 20,000 problems at every level.
2. Budgets estimated once, with the SFT model, on a pool of 256 problems x 3 levels
   (`effort.estimate_budgets`, k = 4 samples per record, a quantile of their lengths times
   the level's multiplier), then fixed for the whole run (`rewards.effort_budget(budgets=)`).
3. RL (k1.5, 150 steps) on that pool from the warm start: reward = correctness, replaced by
   `over_reward` over the record's budget x a schedule that holds 1.5 (loose) for 30 steps
   and falls to 1.0 over 60. With `--seeds S`, S RL runs (seeds 0..S-1) from the same warm
   start and budgets, reported as mean and 95% interval per level.
4. The sampled evaluation's budget sweep once per level (64 test problems, 8 samples) for the
   SFT model and the RL model(s).

Variants (VARIANTS). Second try, demonstrations that ignore the level: "filler",
demonstrations start with 0..8 "hmm;" steps (length the low level can drop without losing the
answer), budgets 0.7 / 1.0 / 1.6 x the median; "shortcut", no filler but 30% of the
demonstrations give the bare answer (short and often wrong, so that tokens buy accuracy),
budgets 0.5 / 1.0 / 1.5 x the upper quartile; "shortcut_penalty", the same with over-budget
reward -1 instead of 0. Third try, a warm start that reads the level (LevelShortcut: 70% /
30% / 10% bare answers at low / high / max): "conditioned", budgets as in shortcut;
"conditioned_own", each level's budget its own upper quartile (multipliers 1 / 1 / 1.5, the
levels' lengths already differ); "conditioned_own_penalty", the same with over-budget -1.
Each variant goes to OUT_DIR/VARIANT and DOCS/second_try_VARIANT[_sft].png, and its numbers
to DOCS/second_try.json ("variants"). Runs resume: a finished stage is read back from OUT_DIR
(a variant reuses another's warm start and budgets when they are copied there).
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import stats  # noqa: E402
from models import config, host_allocator, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from experiments import evaluation  # noqa: E402
from rl import ConfigError, checkpoint, effort, rewards, trainer  # noqa: E402
from rl.config import RLConfig  # noqa: E402
from rl import eval as eval_lib  # noqa: E402
from rl.tasks.arithmetic import Arithmetic  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402

LEVELS = ("low", "high", "max")
ESTIMATE_SAMPLES = 4
POOL = 256                       # RL problems (x 3 levels = 768 records, each budgeted once)
LOOSE, HOLD, TIGHTEN = 1.5, 30, 60
RL_STEPS = 150
RL = RLConfig(prompts_per_step=32, samples_per_prompt=8, max_new_tokens=72, seq_len=160)
SPEC = eval_lib.SampledEval(samples=8, ks=(1, 2, 4, 8), budgets=(16, 24, 32, 48, 72))
EVAL_PROBLEMS = 64


@dataclasses.dataclass(frozen=True)
class LevelShortcut(effort.EffortTask):
  """An EffortTask whose demonstrations answer directly (the bare answer, "#106") in a share
  `direct[level]` of each level's records: a warm start that reads the effort field, but
  only partly obeys it, for RL with budgets to sharpen. Which records is a pure function of
  (problem, level)."""
  direct: tuple[float, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    if len(self.direct) != len(self.levels) or not all(0 <= d <= 1 for d in self.direct):
      raise ConfigError(f"LevelShortcut.direct needs a probability per level {self.levels}, "
                        f"got {self.direct}")

  def solution(self, record):
    share = self.direct[record["effort_level"]]
    if random.Random(f"direct/{record['problem']}/{record['effort']}").random() < share:
      return "#" + record["answer"]
    return self.inner.solution(record)


def tasks(variant: dict):
  """(SFT task: 20,000 problems, RL task: the first POOL of them), both EffortTasks."""
  inner = lambda **kw: Arithmetic(digits=2, operands=3, sloppy=0.0, filler=variant["filler"],
                                  **kw)
  if isinstance(variant["direct"], tuple):
    return (LevelShortcut(inner(), levels=LEVELS, direct=variant["direct"]),
            LevelShortcut(inner(num_train=POOL), levels=LEVELS, direct=variant["direct"]))
  return (effort.EffortTask(inner(direct=variant["direct"]), levels=LEVELS),
          effort.EffortTask(inner(num_train=POOL, direct=variant["direct"]), levels=LEVELS))


# filler: 0..8 "hmm;" steps before the column steps, length that carries no accuracy; budgets
# = median x 0.7 / 1.0 / 1.6. shortcut: no filler, 30% of the demonstrations answer directly
# (5 tokens, often wrong) instead of the column steps (about 18 tokens, right); budgets from
# the upper quartile of the 4 samples (the column mode) x 0.5 / 1.0 / 1.5, so low only fits
# the direct answer and high / max fit the column steps. shortcut_penalty: the same, an
# over-budget completion scores -1 (below a wrong answer, 0), so that the low level, whose
# direct answers are seldom right, still gets a signal.
VARIANTS = {
    "filler": dict(filler=8, direct=0.0, multipliers=(0.7, 1.0, 1.6), quantile=0.5,
                   over_reward=0.0),
    "shortcut": dict(filler=0, direct=0.3, multipliers=(0.5, 1.0, 1.5), quantile=0.75,
                     over_reward=0.0),
    "shortcut_penalty": dict(filler=0, direct=0.3, multipliers=(0.5, 1.0, 1.5),
                             quantile=0.75, over_reward=-1.0),
    "conditioned": dict(filler=0, direct=(0.7, 0.3, 0.1), multipliers=(0.5, 1.0, 1.5),
                        quantile=0.75, over_reward=0.0),
    "conditioned_own": dict(filler=0, direct=(0.7, 0.3, 0.1), multipliers=(1.0, 1.0, 1.5),
                            quantile=0.75, over_reward=0.0),
    "conditioned_own_penalty": dict(filler=0, direct=(0.7, 0.3, 0.1),
                                    multipliers=(1.0, 1.0, 1.5), quantile=0.75,
                                    over_reward=-1.0),
}


def model(vocab: int):
  return config.tiny(vocab, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384)


def run(run_dir: str, *, task, num_steps: int, seed: int, init_from: str | None = None,
        reward=None) -> dict:
  summary = os.path.join(run_dir, "summary.json")
  if os.path.exists(summary) and json.load(open(summary)).get("steps") == num_steps:
    return json.load(open(summary))
  return trainer.train(
      run_dir, task=task, model=model, rl=dataclasses.replace(RL, num_steps=num_steps),
      objective=trainer.Objective(loss="k1.5", reward=reward),
      start=trainer.FromRun(init_from) if init_from else trainer.WarmStart(
          steps=600, batch_size=64, learning_rate=3e-3),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=256), checkpoint_every=25,
                          progress=False), seed=seed)


def by_level(params, cfg, tokenizer, task) -> dict:
  engine = JaxEngine(cfg, params)
  return effort.sampled_eval_by_level(engine, task, tokenizer, SPEC, num_problems=EVAL_PROBLEMS)


def brief(report: dict) -> dict:
  top = report["budgets"][max(report["budgets"], key=int)]
  return {"mean_length": effort.mean_length(report), "accuracy": top["accuracy"],
          "accuracy_by_budget": {str(b): r["accuracy"] for b, r in report["budgets"].items()}}


def over_seeds(reports: dict[int, dict]) -> dict:
  """Per level, the RL models' sampled accuracy and mean length as mean and 95% t interval
  over the seeds (`reports`: seed -> sampled_eval_by_level's report)."""
  seeds = sorted(reports)
  out = {"seeds": seeds}
  for level in LEVELS:
    briefs = [brief(reports[s][level]) for s in seeds]
    out[level] = {
        key: stats.mean_ci([b[key] for b in briefs]).as_dict()
        for key in ("accuracy", "mean_length")}
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variant", choices=sorted(VARIANTS), default="filler")
  parser.add_argument("--out_dir", default="runs/effort2")
  parser.add_argument("--docs", default="docs/effort")
  parser.add_argument("--seeds", type=int, default=1,
                      help="RL runs from the same warm start and budgets, seeds 0..SEEDS-1")
  args = parser.parse_args(argv)
  host_allocator.keep_freed_memory()  # as experiments/run.py does, before JAX starts
  variant = VARIANTS[args.variant]
  sft_task, rl_task = tasks(variant)
  started = time.perf_counter()
  tokenizer = CharTokenizer()
  cfg = model(tokenizer.vocab_size)
  out = lambda name: os.path.join(args.out_dir, args.variant, name)
  like = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))

  # Seconds of the stages that ran (a resumed stage keeps the time of the run that made it).
  seconds_path = out("seconds.json")
  seconds = json.load(open(seconds_path)) if os.path.exists(seconds_path) else {}
  done = lambda name: os.path.exists(out(name))
  timed = lambda stage, ran, since: seconds.update({stage: round(time.perf_counter() - since, 1)}
                                                   ) if ran else None
  t, ran = time.perf_counter(), not done("sft/summary.json")
  sft_summary = run(out("sft"), task=sft_task, num_steps=0, seed=0)
  sft_params = checkpoint.load_policy(out("sft"), like=like)
  timed("sft", ran, t)

  t, ran = time.perf_counter(), not done("budgets.npy")
  budget_path = out("budgets.npy")
  if os.path.exists(budget_path):
    budgets = np.load(budget_path)
  else:  # once, with the warm start (K3), then fixed
    budgets = effort.estimate_budgets(JaxEngine(cfg, sft_params), rl_task, tokenizer,
                                      samples=ESTIMATE_SAMPLES, max_new_tokens=RL.max_new_tokens,
                                      multipliers=variant["multipliers"],
                                      quantile=variant["quantile"])
    np.save(budget_path, budgets)
  levels = effort.level_ids(rl_task)
  budget_stats = {name: {"mean": float(budgets[levels == i].mean()),
                         "median": float(np.median(budgets[levels == i]))}
                  for i, name in enumerate(LEVELS)}
  print(f"budgets from the warm start: {budget_stats}")
  timed("estimate_budgets", ran, t)

  reward = rewards.named_chain({
      "correctness": rewards.correctness(),
      "effort": rewards.effort_budget(
          levels=levels, budgets=budgets, multipliers=variant["multipliers"],
          over_reward=variant["over_reward"],
          schedule=rewards.tightening(loose=LOOSE, tight=1.0, steps=TIGHTEN, hold=HOLD))})
  rl_dir = lambda seed: "rl" if seed == 0 else f"rl_seed{seed}"
  rl_summaries = {}
  for seed in range(args.seeds):  # the same warm start and budgets, RL's seed varies
    t, ran = time.perf_counter(), not done(f"{rl_dir(seed)}/summary.json")
    rl_summaries[seed] = run(out(rl_dir(seed)), task=rl_task, init_from=out("sft"),
                             reward=reward, num_steps=RL_STEPS, seed=seed)
    timed(rl_dir(seed), ran, t)
  rl_summary = rl_summaries[0]

  t = time.perf_counter()
  reports = {"sft": by_level(sft_params, cfg, tokenizer, rl_task)}
  rl_reports = {seed: by_level(checkpoint.load_policy(out(rl_dir(seed)), like=like), cfg,
                               tokenizer, rl_task) for seed in rl_summaries}
  reports["rl"] = rl_reports[0]
  timed("eval", True, t)
  with open(seconds_path, "w") as f:
    json.dump(seconds, f)

  for name, report in reports.items():
    for level, r in report.items():
      print(f"{args.variant} {name} effort {level}: accuracy={brief(r)['accuracy']:.3f} "
            f"mean_length={brief(r)['mean_length']:.1f}")
  os.makedirs(args.docs, exist_ok=True)
  for name, stage in (("rl", "after RL"), ("sft", "the SFT warm start")):
    plot = evaluation.write_level_plot(reports[name], out(f"{name}_eval"),
                                   title=f"{args.variant}: {stage}")
    suffix = "" if name == "rl" else "_sft"
    shutil.copy(plot, os.path.join(args.docs, f"second_try_{args.variant}{suffix}.png"))
  result = {
      "command": f"python experiments/effort_demo.py --variant {args.variant}",
      "design": {**variant, "levels": LEVELS, "estimate_samples": ESTIMATE_SAMPLES,
                 "rl_problems": POOL, "rl_records": len(rl_task.train),
                 "schedule": {"loose": LOOSE, "hold": HOLD, "tighten_steps": TIGHTEN,
                              "tight": 1.0},
                 "task": "EffortTask(Arithmetic(digits=2, operands=3, sloppy=0))",
                 "rl_steps": RL_STEPS, "seed": 0,
                 "eval": f"{EVAL_PROBLEMS} test problems x {SPEC.samples} samples per level"},
      "budgets": budget_stats,
      "greedy_accuracy_after_sft": sft_summary["sft_accuracy"],
      "greedy_length_after_sft": sft_summary.get("sft_length"),
      "greedy_accuracy_after_rl": rl_summary["rl_accuracy"],
      "greedy_length_after_rl": rl_summary.get("rl_length"),
      "by_level": {name: {level: brief(r) for level, r in report.items()}
                   for name, report in reports.items()},
      "rl_over_seeds": over_seeds(rl_reports),
      "seconds": seconds,
  }
  path = os.path.join(args.docs, "second_try.json")
  everything = json.load(open(path)) if os.path.exists(path) else {}
  everything = everything if "variants" in everything else {"variants": {}}
  everything["variants"][args.variant] = result
  with open(path, "w") as f:
    json.dump(everything, f, indent=2)
  print(f"wrote {path}, {args.docs}/second_try_{args.variant}[_sft].png "
        f"({time.perf_counter() - started:.0f}s)")
  return result


if __name__ == "__main__":
  main()
