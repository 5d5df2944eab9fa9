"""Whether a configuration makes a reproducible run: run it twice for a few RL steps as a
reproducible run (RLConfig.deterministic = True), each into a directory of its own, and compare
the two as scripts/same_run.py does (every metrics.jsonl record and summary.json field,
timings aside, and every array of the last checkpoint bit for bit).

    .venv/bin/python scripts/check_determinism.py --gin FILE [--gin FILE ...]
        [--gin_param BINDING ...] [--steps 2] [--second BINDING ...] [--keep DIR]

Prints "same run" and exits 0, or the first field that differs (and how many more do) and
exits 1; a run that fails prints the tail of its output and exits 2. `--second BINDING`
applies to the second run only: whether a binding that should change nothing (e.g.
"Hooks.checkpoint_every = 1") keeps the run as it is. `--keep DIR` keeps the runs in DIR/a and
DIR/b (scripts/same_run.py DIR/a DIR/b then lists every difference); else they go to a
temporary directory, removed at the end.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import same_run  # noqa: E402


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", default=[], metavar="FILE",
                      help="gin config file (as experiments/run.py takes them); repeatable")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING",
                      help="one gin binding for both runs; repeatable")
  parser.add_argument("--steps", type=int, default=2, help="RL steps of each run")
  parser.add_argument("--second", action="append", default=[], metavar="BINDING",
                      help="a binding for the second run only; repeatable")
  parser.add_argument("--keep", metavar="DIR", help="keep the runs in DIR/a and DIR/b")
  args = parser.parse_args(argv)
  if not args.gin:
    parser.error("give at least one --gin FILE (e.g. experiments/configs/quickstart.gin)")
  if args.steps < 1:
    parser.error(f"--steps must be >= 1, got {args.steps}")
  return args


def run(files, bindings, run_dir: str) -> float:
  """experiments/run.py on `files` and `bindings` into `run_dir`; its wall-clock seconds.
  SystemExit(2) with the tail of its output when it fails."""
  command = [sys.executable, os.path.join(ROOT, "experiments/run.py"), "--run_dir", run_dir]
  command += [arg for path in files for arg in ("--gin", path)]
  command += [arg for binding in bindings for arg in ("--gin_param", binding)]
  started = time.perf_counter()
  result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
  if result.returncode != 0:
    print((result.stdout + result.stderr)[-3000:], file=sys.stderr)
    raise SystemExit(2)
  return time.perf_counter() - started


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  base = args.keep or tempfile.mkdtemp(prefix="longrl-determinism-")
  runs = [os.path.join(base, "a"), os.path.join(base, "b")]
  if any(os.path.exists(r) for r in runs):
    raise SystemExit(f"error: {runs[0]} or {runs[1]} exists; a reproducible run starts afresh")
  bindings = [*args.gin_param, "RLConfig.deterministic = True",
              f"RLConfig.num_steps = {args.steps}", "Hooks.progress = False"]
  try:
    for name, run_dir, extra in (("first", runs[0], []), ("second", runs[1], args.second)):
      print(f"{name} run: {run(args.gin, bindings + extra, run_dir):.1f} s", flush=True)
    differences, notes = same_run.compare(*runs)
  finally:
    if not args.keep:
      shutil.rmtree(base, ignore_errors=True)
  for note in notes:
    print(note)
  if not differences:
    print(f"same run ({args.steps} steps)")
    return 0
  more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
  print(f"first difference: {differences[0]}{more}")
  return 1


if __name__ == "__main__":
  sys.exit(main())
