"""Whether two run directories hold the same run: every metrics.jsonl record and summary.json
field (wall-clock seconds aside) and every array of the last checkpoint bit for bit.

    .venv/bin/python scripts/same_run.py RUN_A RUN_B

Prints what differs and exits 1, or prints "same run" and exits 0. Arrays that only one
checkpoint holds (the loop state's layout changed with the code) are listed, not counted as
differences. For a change meant to keep
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


def compare(run_a: str, run_b: str) -> tuple[list[str], list[str]]:
  """(what differs between the two runs, empty for the same run; the arrays only one
  checkpoint holds)."""
  out, notes = [], []
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
  for path_a, path_b in _pairs(arrays_a, arrays_b, notes):
    a, b = arrays_a[path_a], arrays_b[path_b]
    if a.shape != b.shape or not np.array_equal(a, b):
      diff = "shapes differ" if a.shape != b.shape else (
          f"max |a - b| {np.abs(a.astype(np.float64) - b.astype(np.float64)).max():.3g}")
      out.append(f"checkpoint: {path_a} differs ({diff})")
  return out, notes


def _pairs(arrays_a: dict, arrays_b: dict, notes: list[str]) -> list[tuple[str, str]]:
  """Paths of the same array in both checkpoints. The loop state's layout may change with
  the code: a path only one has is matched to the one path of the other that ends with it
  (['rng'] and ['rollout']['rng']); what stays unmatched is named in `notes`."""
  pairs = [(p, p) for p in sorted(set(arrays_a) & set(arrays_b))]
  only_a, only_b = sorted(set(arrays_a) - set(arrays_b)), sorted(set(arrays_b) - set(arrays_a))
  for path in only_a:
    matches = [q for q in only_b if q.endswith(path) or path.endswith(q)]
    if len(matches) == 1:
      pairs.append((path, matches[0]))
      only_b.remove(matches[0])
    else:
      notes.append(f"checkpoint: {path} only in the first")
  notes += [f"checkpoint: {path} only in the second" for path in only_b]
  return pairs


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    raise SystemExit(__doc__)
  differences, notes = compare(*argv)
  for line in notes + differences:
    print(line)
  if not differences:
    print("same run")
  return 1 if differences else 0


if __name__ == "__main__":
  sys.exit(main())
