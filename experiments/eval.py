"""Evaluate a checkpoint on a task: `python experiments/eval.py --gin FILE [--gin_param B ...]
[--out DIR]`.

For a longrl run directory (its latest RL checkpoint; the model config comes from the same
gin bindings the run used, e.g. by including its config file) or a Hugging Face checkpoint
directory (config, safetensors and tokenizer; prompts go through its chat template), draws
`samples` completions per prompt at the largest token budget and writes to the output
directory report.json (pass@k, maj@k, mean@k per budget, lengths by correctness) and
accuracy_vs_budget.png, lengths.png, pass_at_k.png; for an EffortTask (rl/effort.py) the
sweep once per effort level too (accuracy_vs_budget_by_effort.png). See
experiments/configs/eval.gin.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402

from experiments import gin_externals  # noqa: E402
from rl import effort  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", default=[], metavar="FILE")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING")
  parser.add_argument("--out", help="overrides evaluate.out_dir")
  args = parser.parse_args(argv if argv is not None else sys.argv[1:])
  if not args.gin:
    parser.error("give at least one --gin FILE (e.g. experiments/configs/eval.gin)")
  for path in args.gin:
    if not os.path.isfile(path):
      raise SystemExit(f"error: gin config file not found: {path}")
  bindings = args.gin_param + ([f"evaluate.out_dir = {args.out!r}"] if args.out else [])
  try:
    gin.parse_config_files_and_bindings(args.gin, bindings, finalize_config=False)
  except (ValueError, KeyError, TypeError, SyntaxError) as e:
    raise SystemExit(f"error in gin config: {e}") from None
  try:
    report, paths = gin_externals.evaluate()
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  top = report["budgets"][max(report["budgets"])]
  print(" ".join(f"{key}={value:.3f}" for key, value in top.items()))
  for level, by_level in report.get("effort", {}).items():  # an rl.effort.EffortTask
    at = by_level["budgets"][max(by_level["budgets"])]
    print(f"effort {level}: accuracy={at['accuracy']:.3f} mean_length="
          f"{effort.mean_length(by_level):.1f}")
  print("wrote " + ", ".join(paths))
  return report


if __name__ == "__main__":
  main()
