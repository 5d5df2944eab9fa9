"""Partial rollouts vs waiting for the longest completion, not a test: completed tokens per
second of RL iterations on a skewed length distribution, measured in the same run.

  python bench/partial_rollouts.py [--out bench/results]

A tiny model is fine-tuned to answer with a short completion (12 tokens) 85% of the time and
an 8x longer one (96 tokens) otherwise, then served by a `rollouts.server` process (the embedded
engine behind SGLang's protocol, as in CI). Each RL iteration asks for 4 groups x 8 samples.
"wait" generates every trajectory to the end; "partial" (rl.envs.driver with a Pause, as
rl.sources.Partial runs it) ends the
iteration once the completions received hold 80% of the short answers' expected tokens, aborts
the rest and resumes them in later iterations. Both run the same number of iterations after
WARMUP iterations (which fill partial's pipeline of resumed trajectories); completed tokens are
the lengths of trajectories that finished in the measured iterations. ROUNDS rounds of one run
of each mode alternate; the figure is the median round's ratio (one disturbed round on a shared
machine moves it least), the pooled ratio is printed too.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from models import config, hf, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import envs, sft  # noqa: E402
from rl.envs import driver  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.server.main import launch  # noqa: E402
from rollouts.sglang import Request, SGLangClient  # noqa: E402
from rollouts.sglang_engine import SGLangEngine  # noqa: E402

SHORT, LONG, LONG_SHARE = 12, 96, 0.15
GROUPS, SAMPLES, ITERATIONS, WARMUP = 4, 8, 24, 8
ROUNDS = 4  # of (wait, partial), interleaved: the ratio reported is the median round's


class SkewedLengths:
  """Prompt "go:"; the demonstration is SHORT or LONG letters."""

  def __init__(self, n=400, seed=0):
    rng = random.Random(seed)
    self.train = [{"length": LONG if rng.random() < LONG_SHARE else SHORT} for _ in range(n)]
    self.test = self.train

  def prompt(self, record):
    return "go:"

  def solution(self, record):
    return "a" * record["length"]


def trained_model(tokenizer):
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=128)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  params, _ = sft.warm_start(params, cfg, SkewedLengths(), tokenizer, steps=300, batch_size=32,
                             seq_len=128, learning_rate=3e-3, progress=False)
  return cfg, params


def run(engine, tokenizer, prompt, sampling, mode, budget):
  """(completed tokens, generated tokens, seconds, lengths of finished) over ITERATIONS."""
  pending, completed, generated, finished_lengths = [], 0, 0, []
  seconds = 0.0
  for it in range(WARMUP + ITERATIONS):
    fresh = driver.start(envs.ONE_TURN, [{}] * (GROUPS * SAMPLES),
                         [prompt] * (GROUPS * SAMPLES),
                         group=[it * GROUPS + i // SAMPLES for i in range(GROUPS * SAMPLES)])
    started = time.perf_counter()
    if mode == "wait":
      completions = engine.client.generate(
          [Request(f"w{it}-{i}", tuple(prompt), sampling.max_new_tokens, sampling_seed=it * 97 + i)
           for i in range(len(fresh))], sampling)
      done = [len(c.token_ids) for c in completions]
      made = sum(done)
    else:
      before = sum(len(t.token_ids) for t in pending)
      pending += fresh
      driver.advance(engine, envs.ONE_TURN, tokenizer, pending, sampling, seed=it,
                     pause=driver.Pause(token_budget=budget))
      made = sum(len(t.token_ids) for t in pending) - before
      done = [len(t.token_ids) for t in pending if t.over]
      pending = [t for t in pending if not t.over]
    elapsed = time.perf_counter() - started
    if it >= WARMUP:  # fills the pipeline of resumed trajectories (partial) first
      seconds += elapsed
      completed += sum(done)
      generated += made
      finished_lengths += done
  return completed, generated, seconds, finished_lengths


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  tokenizer = CharTokenizer()
  cfg, params = trained_model(tokenizer)
  weights = tempfile.mkdtemp(prefix="bench-partial-")
  process, url = launch(["--hf_checkpoint", hf.save(params, cfg, os.path.join(weights, "v0")),
                         "--max_batch", "96", "--warmup_len", str(LONG + 16),
                         "--dtype", "float32"])
  # One core each for the server and this process (the client), every thread of both: on a
  # 2-core machine they otherwise trade cores with XLA's thread pools, and the timings scatter.
  if len(os.sched_getaffinity(0)) >= 2:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    for pid, core in ((process.pid, second), (os.getpid(), first)):
      for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {core})
  try:
    engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir=weights)
    prompt = tokenizer.encode("go:", add_bos=True)
    sampling = SamplingParams(max_new_tokens=LONG + 8, temperature=1.0,
                              stop_token_ids=(tokenizer.eos_id,))
    # Somewhat under the short answers' expected tokens, so that an iteration that drew more
    # long ones than average still ends before they do.
    budget = int(0.8 * GROUPS * SAMPLES * (1 - LONG_SHARE) * (SHORT + 1))
    # The server compiled every batch shape before serving (--warmup_len): a compile inside
    # the timed part (seconds on a CPU) would swamp the difference measured. One untimed run
    # of each mode warms the rest (connections, the client's first calls).
    for mode in ("wait", "partial"):
      run(engine, tokenizer, prompt, sampling, mode, budget)
    results, rounds = {}, []
    for _ in range(ROUNDS):
      per_second = {}
      for mode in ("wait", "partial"):
        completed, generated, seconds, lengths = run(engine, tokenizer, prompt, sampling, mode, budget)
        per_second[mode] = completed / seconds
        r = results.setdefault(mode, {"completed_tokens": 0, "generated_tokens": 0,
                                      "seconds": 0.0, "finished": 0, "long_finished": 0})
        r["completed_tokens"] += completed
        r["generated_tokens"] += generated
        r["seconds"] += seconds
        r["finished"] += len(lengths)
        r["long_finished"] += sum(n > 2 * SHORT for n in lengths)
      rounds.append(per_second["partial"] / per_second["wait"])
  finally:
    process.kill()
  for mode, r in results.items():
    r["completed_tokens_per_second"] = r["completed_tokens"] / r["seconds"]
    print(f"{mode:>8}: {r['completed_tokens']} completed tokens ({r['finished']} trajectories, "
          f"{r['long_finished']} long) in {r['seconds']:.2f} s = "
          f"{r['completed_tokens_per_second']:.1f} tokens/s; generated {r['generated_tokens']}")
  pooled = (results["partial"]["completed_tokens_per_second"]
            / results["wait"]["completed_tokens_per_second"])
  ratio = statistics.median(rounds)
  print(f"partial / wait per round: {', '.join(f'{x:.2f}' for x in rounds)}; pooled "
        f"{pooled:.2f}")
  print(f"partial / wait = {ratio:.2f}, the median round (target >= 1.5); token budget per "
        f"iteration {budget}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "partial_rollouts.json"), "w") as f:
    json.dump({"results": results, "ratio": ratio, "rounds": rounds, "pooled": pooled,
               "budget": budget, "short": SHORT,
               "long": LONG, "long_share": LONG_SHARE, "groups": GROUPS, "samples": SAMPLES,
               "iterations": ROUNDS * ITERATIONS}, f, indent=2)


if __name__ == "__main__":
  main()
