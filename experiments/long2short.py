"""Apply one long2short method to a trained run: `python experiments/long2short.py --gin FILE
--method {shortest_rejection,dpo,merge} --out_dir DIR [--merge_with RUN_DIR]
[--gin_param BINDING ...]`.

The gin files bind `long2short.*` (rl.long2short.run: the long run, the model config factory,
the task, sampling and training sizes; see experiments/configs/findings/h_long2short.gin).
DIR receives the new model (usable as a FromRun start or by experiments/eval.py) and
summary.json with the held-out accuracy and mean length before and after.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402

from experiments import gin_externals  # noqa: E402
from rl import long2short  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", required=True, metavar="FILE")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING")
  parser.add_argument("--method", required=True, choices=long2short.METHODS)
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--merge_with", help="the short model's run dir (method merge)")
  args = parser.parse_args(argv)
  for path in args.gin:
    if not os.path.isfile(path):
      raise SystemExit(f"error: gin config file not found: {path}")
  try:
    gin.parse_config_files_and_bindings(args.gin, args.gin_param, finalize_config=False)
  except (ValueError, KeyError, TypeError, SyntaxError) as e:
    raise SystemExit(f"error in gin config: {e}") from None
  try:
    return gin_externals.long2short(args.out_dir, method=args.method,
                                    merge_with=args.merge_with)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  main()
