"""Whether two run directories hold the same run: every metrics.jsonl record and summary.json
field (wall-clock seconds aside) and every array of the last checkpoint bit for bit.

    .venv/bin/python scripts/same_run.py RUN_A RUN_B

Prints what differs and exits 1, or prints "same run" and exits 0. For a change meant to keep
behaviour (a refactor): run the quickstart before and after it into two directories and
compare them here.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def _timing(key: str) -> bool:
  """Wall-clock fields, which differ between any two runs."""
  return key.endswith("_s") or key.endswith("_seconds") or key == "seconds"


def _records(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _differences(a: dict, b: dict, where: str) -> list[str]:
  out = []
  for key in sorted(set(a) | set(b)):
    if _timing(key):
      continue
    if key not in a or key not in b:
      out.append(f"{where}: {key} only in {'the second' if key in b else 'the first'}")
    elif a[key] != b[key] and not (a[key] != a[key] and b[key] != b[key]):  # NaN == NaN here
      out.append(f"{where}: {key} {a[key]!r} != {b[key]!r}")
  return out


def _checkpoint(run_dir: str):
  """The last checkpoint's arrays, by path, as numpy."""
  import orbax.checkpoint as ocp
  directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
  manager = ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler())
  step = manager.latest_step()
  tree = manager.restore(step, args=ocp.args.StandardRestore())
  manager.close()
  import jax
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return step, {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def compare(run_a: str, run_b: str) -> list[str]:
  """What differs between the two runs (empty: the same run)."""
  out = []
  records_a, records_b = _records(run_a), _records(run_b)
  if len(records_a) != len(records_b):
    out.append(f"metrics.jsonl: {len(records_a)} records != {len(records_b)}")
  for i, (a, b) in enumerate(zip(records_a, records_b)):
    out += _differences(a, b, f"metrics.jsonl record {i} (step {a.get('step')})")
  summaries = [json.load(open(os.path.join(r, "summary.json"))) for r in (run_a, run_b)]
  out += _differences(*summaries, "summary.json")
  (step_a, arrays_a), (step_b, arrays_b) = _checkpoint(run_a), _checkpoint(run_b)
  if step_a != step_b:
    out.append(f"last checkpoint: step {step_a} != {step_b}")
  # The loop state's layout may change with the code: compare the arrays both have, by value
  # and by path, and name the ones only one has.
  for path in sorted(set(arrays_a) | set(arrays_b)):
    if path not in arrays_a or path not in arrays_b:
      out.append(f"checkpoint: {path} only in {'the second' if path in arrays_b else 'the first'}")
    elif not np.array_equal(arrays_a[path], arrays_b[path]):
      diff = np.abs(arrays_a[path].astype(np.float64) - arrays_b[path].astype(np.float64))
      out.append(f"checkpoint: {path} differs (max |a - b| {diff.max():.3g})")
  return out


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    raise SystemExit(__doc__)
  differences = compare(*argv)
  for line in differences:
    print(line)
  if not differences:
    print("same run")
  return 1 if differences else 0


if __name__ == "__main__":
  sys.exit(main())
