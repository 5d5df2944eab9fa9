"""RL steps on long rows (not a test): experiments/configs/long_context.gin at 32k, 64k and 128k
tokens per row, each in a process of its own.

  python bench/long_context.py [--lengths 32768,65536,131072] [--out bench/results]

For each length L the haystack is L - 72 tokens (room for the 8-token completion in a row of L)
and the run is the config's: a tiny model from random init, one RL step of 2 samples of one
prompt (2 rows of L tokens), a greedy evaluation of one test prompt before and after it. The
figures: the process's peak resident memory (ru_maxrss), its wall seconds, and the step's
parts from metrics.jsonl: generate_s (the engine's prefill of two L-token prompts and its 8
decode steps), score_s (drawing the prompts: building and tokenizing the haystacks; rewards
and statistics) and train_s (the trainer's log-probs and the k1.5 train step on both rows).
Memory linear in L is the target; attention's time grows as L^2. The table divides each
figure by its 32k value.

Results go to OUT/long_context.json and are printed as a table.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "long_context.gin")
LENGTHS = (32768, 65536, 131072)
ROOM = 72  # tokens of a row left for the completion (max_new_tokens = 8) and the "?key="
PARTS = ("generate_s", "score_s", "train_s")
GiB = 2 ** 30


def child(length: int, run_dir: str, out: str) -> None:
  """One run of the config at `length` tokens per row, in this process; writes its seconds
  and peak RSS to `out`."""
  sys.path.insert(0, ROOT)
  from experiments import run
  start = time.perf_counter()
  run.main(["--gin", CONFIG, "--run_dir", run_dir,
            "--gin_param", f"Needle.context = {length - ROOM}",
            "--gin_param", f"RLConfig.seq_len = {length}",
            "--gin_param", "Hooks.progress = False"])
  with open(out, "w") as f:
    json.dump({"seconds": time.perf_counter() - start,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)


def measure(length: int) -> dict:
  with tempfile.TemporaryDirectory() as run_dir:
    out = os.path.join(run_dir, "peak.json")
    proc = subprocess.run([sys.executable, __file__, "--_child", str(length), run_dir, out],
                          cwd=ROOT)
    if proc.returncode:
      raise SystemExit(f"the run at {length} tokens failed (exit {proc.returncode})")
    with open(out) as f:
      row = {"seq": length, **json.load(f)}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      steps = [json.loads(line) for line in f if '"train_s"' in line]
  row.update({part: steps[-1][part] for part in PARTS})
  print(row, flush=True)
  return row


def table(rows) -> str:
  base = rows[0]
  lines = [f"one RL step of experiments/configs/long_context.gin (2 rows), 2-core CPU",
           f"{'tokens/row':>10} {'peak RSS':>10} {'run':>8} " + " ".join(f"{p:>10}" for p in PARTS)]
  for r in rows:
    lines.append(f"{r['seq']:>10} {r['peak_rss_bytes'] / GiB:>6.2f} GiB {r['seconds']:>6.0f} s "
                 + " ".join(f"{r[p]:>8.1f} s" for p in PARTS))
  for r in rows[1:]:
    ratio = lambda key: r[key] / base[key]
    lines.append(f"{r['seq']} / {base['seq']} ({r['seq'] / base['seq']:.0f}x the tokens): peak RSS "
                 f"{ratio('peak_rss_bytes'):.2f}x, "
                 + ", ".join(f"{p} {ratio(p):.2f}x" for p in PARTS))
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._child:
    child(int(args._child[0]), *args._child[1:])
    return
  rows = [measure(int(n)) for n in args.lengths.split(",")]
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "long_context.json")
  with open(path, "w") as f:
    json.dump(rows, f, indent=1)
  print(table(rows))
  print(f"results: {path}")


if __name__ == "__main__":
  main()
