"""Rollout routing replay on a tiny mixture of experts, on a 2-core CPU.

  python experiments/replay_demo.py [--out_dir runs/replay] [--docs docs/moe] [--steps 150]
                                    [--seeds 1] [--jobs 2] [--threads 1]

The quickstart (experiments/configs/quickstart_moe.gin: a tiny Qwen3-MoE, 8 experts with 2
a token in both layers, the embedded engine in bf16, the trainer in float32) from the same
seeds without routing replay and with it (experiments/seeds.py runs them, in OUT_DIR/ARM/
seed<k>, skipping finished ones). Per step each logs the engine-trainer log-prob mismatch
over the completion tokens before the update (engine_logp_diff_mean / _max), the share of
tokens the trainer routed otherwise than the engine (routing_differs) and where its router
alone would have (router_differs); each run's summary holds its held-out greedy accuracy
after SFT and after RL. Per seed, the medians, means and maxima over steps and the
accuracies go to DOCS/results.json, seed 0's curves to DOCS/plot.png, and a table of the
means (and the largest engine_logp_diff_max) to stdout.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import seeds as seeds_lib  # noqa: E402

CONFIG = os.path.join(ROOT, "experiments/configs/quickstart_moe.gin")
ARMS = {"off": False, "on": True}  # the arm's name -> Objective.routing_replay
METRICS = ("engine_logp_diff_mean", "engine_logp_diff_max", "routing_differs",
           "router_differs")


def read_run(run_dir: str) -> dict:
  """A run's per-step METRICS, their medians, means and maxima over steps, and its
  accuracies after SFT and after RL."""
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  steps = [r for r in records if "train_s" in r]
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  curves = {m: [r[m] for r in steps] for m in METRICS}
  return {"curves": {"step": [r["step"] for r in steps], **curves},
          **{stat: {m: float(f(v)) for m, v in curves.items()}
             for stat, f in (("median", np.median), ("mean", np.mean), ("max", np.max))},
          "sft_accuracy": summary["sft_accuracy"], "rl_accuracy": summary["rl_accuracy"]}


def plot(runs: dict, path: str) -> None:
  """Seed 0's curves of each arm (runs: arm -> its read_run)."""
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  for name, run in runs.items():
    c = run["curves"]
    axes[0].plot(c["step"], c["routing_differs"], label=f"replay {name}: trainer's routing")
    if name == "on":
      axes[0].plot(c["step"], c["router_differs"], ":", label="replay on: its router alone")
    axes[1].plot(c["step"], c["engine_logp_diff_mean"], label=f"replay {name}")
    axes[2].plot(c["step"], c["engine_logp_diff_max"], label=f"replay {name}")
  titles = ("tokens routed otherwise than the engine", "|engine - trainer| log-prob, mean",
            "|engine - trainer| log-prob, max")
  for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs/replay"))
  parser.add_argument("--docs", default=os.path.join(ROOT, "docs/moe"))
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--seeds", type=int, default=1)
  parser.add_argument("--jobs", type=int, default=None, help="runs at once")
  parser.add_argument("--threads", type=int, default=seeds_lib.THREADS, help="cores per run")
  args = parser.parse_args(argv)
  jobs = []
  for name, replay in ARMS.items():
    jobs += seeds_lib.config_jobs(
        [CONFIG], [f"RLConfig.num_steps = {args.steps}", f"Objective.routing_replay = {replay}"],
        os.path.join(args.out_dir, name), range(args.seeds))
  seeds_lib.run_jobs(jobs, parallel=args.jobs, threads=args.threads)
  runs = {name: [read_run(seeds_lib.seed_dir(os.path.join(args.out_dir, name), k))
                 for k in range(args.seeds)] for name in ARMS}
  os.makedirs(args.docs, exist_ok=True)
  with open(os.path.join(args.docs, "results.json"), "w") as f:
    json.dump({"steps": args.steps, "arms": {name: [{k: v for k, v in run.items()
                                                      if k != "curves"} for run in seeds]
                                             for name, seeds in runs.items()}}, f, indent=1)
  plot({name: seeds[0] for name, seeds in runs.items()}, os.path.join(args.docs, "plot.png"))
  print(f"{'replay':8s}{'seed':>5s}" + "".join(f"{'mean ' + m:>28s}" for m in METRICS)
        + f"{'largest diff_max':>18s}{'sft -> rl':>16s}")
  for name, seeds in runs.items():
    for k, run in enumerate(seeds):
      print(f"{name:8s}{k:5d}" + "".join(f"{run['mean'][m]:28.4g}" for m in METRICS)
            + f"{run['max']['engine_logp_diff_max']:18.4g}"
            + f"{run['sft_accuracy']:10.3f} -> {run['rl_accuracy']:.3f}")


if __name__ == "__main__":
  main()
