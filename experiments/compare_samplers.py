"""Prompt samplers at equal steps: one SFT warm start, then the same RL run with each sampler,
and a markdown table of the results.

    python experiments/compare_samplers.py --gin experiments/configs/quickstart.gin \
        --run_dir runs/samplers [--gin_param BINDING ...]

Each variant is `experiments/run.py` with one extra binding, resumed from a copy of the shared
SFT checkpoint, so the variants differ only in the sampler.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLERS = {
    "uniform": ["Objective.sampler = @sampling.uniform()"],
    "prioritized (1 - s)": ["Objective.sampler = @sampling.prioritized()"],
    "curriculum (easy first)": [
        "Objective.sampler = @sampling.curriculum()",
        "sampling.curriculum.highest = @optax.linear_schedule()",
        "optax.linear_schedule.init_value = 0.5",
        "optax.linear_schedule.end_value = 1.0",
        "optax.linear_schedule.transition_steps = 100",
    ],
}


def run(gin_files, bindings, run_dir):
  args = [sys.executable, os.path.join(ROOT, "experiments/run.py"), "--run_dir", run_dir]
  for f in gin_files:
    args += ["--gin", f]
  for b in ["Hooks.progress = False", *bindings]:
    args += ["--gin_param", b]
  subprocess.run(args, check=True, cwd=ROOT)
  return json.load(open(os.path.join(run_dir, "summary.json")))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", required=True)
  parser.add_argument("--gin_param", action="append", default=[])
  parser.add_argument("--run_dir", required=True)
  args = parser.parse_args()
  base = os.path.join(args.run_dir, "sft")
  if not os.path.exists(os.path.join(base, "summary.json")):
    run(args.gin, [*args.gin_param, "RLConfig.num_steps = 0"], base)
  rows = []
  for name, bindings in SAMPLERS.items():
    run_dir = os.path.join(args.run_dir, name.split()[0])
    if not os.path.exists(run_dir):
      shutil.copytree(base, run_dir)
    summary = run(args.gin, [*args.gin_param, *bindings], run_dir)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train_acc = [r["accuracy"] for r in records if "accuracy" in r]
    rows.append((name, summary["steps"], summary["sft_accuracy"], summary["rl_accuracy"],
                 sum(train_acc[-20:]) / max(len(train_acc[-20:]), 1)))
  print("| sampler | RL steps | held-out acc. after SFT | held-out acc. after RL "
        "| train acc. (last 20 steps) |")
  print("|---|---|---|---|---|")
  for name, steps, sft, rl, train in rows:
    print(f"| {name} | {steps} | {sft:.3f} | {rl:.3f} | {train:.3f} |")


if __name__ == "__main__":
  main()
