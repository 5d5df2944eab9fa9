"""Multi-turn episodes in waves vs one episode at a time, not a test: episodes per second and
policy tokens per second of rl/envs/driver.py over the same embedded engine, in the same run.

  python bench/agentic.py [--episodes 64] [--rounds 7] [--min_batch 1] [--out bench/results]

The policy is real: models.config.tiny at experiments/configs/agentic.gin's size (width 128,
2 layers), SFT'd for SFT_STEPS on ToolArithmetic (two operands of 1-6 digits) where
CALL_FRACTION of the demonstrations with a 3+ digit operand call the calculator
(`<calc>a+b</calc>`, the result, then `#sum`) and every other one answers directly (`#sum`).
Sampled at temperature 1, its episodes are one turn or two (three if it called twice), from
3 to ~36 policy tokens: the output gives the distribution of both, per mode. The episodes are
the first `--episodes` held-out problems, under agentic.gin's budgets (48 policy tokens per
episode, 32 per turn, 128 tokens per sequence).

"waves": one run_episodes over all episodes (every active episode's next turn goes into the
same engine call, one call per token-allowance bucket of a wave). "one at a time":
run_episodes on each episode alone, in turn: the same driver code, the same engine object,
sampling and budgets; only the batching differs. By default the engine pads a batch to no
more rows than it has (JaxEngine(min_batch=1)), so a lone episode pays for no padding rows:
the baseline in its strongest form. `--min_batch 8` is the engine as the loop builds it
(JaxEngine's default), where a lone episode's calls run 8 rows. The two modes draw different
tokens (a batch's rows share one random key per step), so each reports its own distribution
of lengths, and policy tokens/s is the measure that does not depend on it.

Counted: the wall-clock time of the run_episodes calls, i.e. the engine calls (building the
padded batch, prefill, decode, the copy back to the host), the driver's bookkeeping,
stop-string checks, decoding turns, and the calculator's calls on the driver's thread pool.
Not counted: SFT, encoding the prompts, and compilation: each mode first runs once untimed
with the seeds of the timed runs, so every shape these meet (JaxEngine compiles one per batch
bucket, prompt-length bucket and token allowance) is compiled by then. ROUNDS rounds of both
modes (the order alternating) repeat the same work: the same seeds give the same tokens. The
ratio reported is the median round's; the pooled one is printed too.

Per mode the table also gives the engine's side of it, from a wrapper that counts every
generate call: the calls, their decode steps (the longest completion of each call: the
decode loop stops when its last row does) and their utilisation, the tokens generated over
episodes x decode steps (padding rows not counted): what short turns waiting for the longest
of their call cost. "engine" is the share of the run's time spent inside generate.
"""

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import config, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import envs, sft  # noqa: E402
from rl.rollout import prompt_ids  # noqa: E402
from rl.tasks.agentic import ToolArithmetic  # noqa: E402
from rl.tasks.arithmetic import Arithmetic  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402

SFT_STEPS, SFT_BATCH = 400, 32
CALL_FRACTION = 0.5
MAX_NEW_TOKENS, MAX_TURN_TOKENS, SEQ_LEN = 48, 32, 128  # experiments/configs/agentic.gin's
SEED = 0
ROUNDS = 7
MODES = ("one_at_a_time", "waves")


class CountingEngine:
  """A RolloutEngine that forwards to `engine` and records each generate call: rows, decode
  steps (its longest completion), tokens generated, seconds."""

  def __init__(self, engine):
    self.engine = engine
    self.calls: list[dict] = []

  @property
  def version(self) -> int:
    return self.engine.version

  @property
  def capabilities(self):
    return self.engine.capabilities

  def update_weights(self, params, version: int, *, while_generating: bool = False) -> float:
    return self.engine.update_weights(params, version, while_generating=while_generating)

  def close(self) -> None:
    self.engine.close()

  def generate(self, prompts, sampling, *, seed, **kwargs):
    started = time.perf_counter()
    completions = self.engine.generate(prompts, sampling, seed=seed, **kwargs)
    lengths = [len(c.token_ids) for c in completions]
    self.calls.append({"rows": len(prompts), "steps": max(lengths, default=0),
                       "tokens": sum(lengths), "seconds": time.perf_counter() - started})
    return completions


def trained_policy(task, tokenizer):
  """(cfg, params) of the tiny model SFT'd on the task's demonstrations."""
  cfg = config.tiny(tokenizer.vocab_size)
  params = transformer.init_params(cfg, jax.random.PRNGKey(SEED))
  params, loss = sft.warm_start(params, cfg, task, tokenizer, steps=SFT_STEPS,
                                batch_size=SFT_BATCH, seq_len=SEQ_LEN, learning_rate=3e-3,
                                seed=SEED, progress=False)
  return cfg, params, loss


def run_mode(mode, engine, task, tokenizer, records, prompts, sampling):
  """The episodes of one mode, in order of `records`."""
  kwargs = {"max_sequence_tokens": SEQ_LEN}
  if mode == "waves":
    return envs.run_episodes(engine, task.environment, tokenizer, records, prompts, sampling,
                             seed=SEED, **kwargs)
  return [envs.run_episodes(engine, task.environment, tokenizer, [record], [prompt], sampling,
                            seed=SEED + i, **kwargs)[0]
          for i, (record, prompt) in enumerate(zip(records, prompts))]


def timed(mode, engine, task, tokenizer, records, prompts, sampling):
  """(episodes, seconds, the engine calls made) of one run of `mode`."""
  engine.calls = []
  started = time.perf_counter()
  episodes = run_mode(mode, engine, task, tokenizer, records, prompts, sampling)
  return episodes, time.perf_counter() - started, engine.calls


def quartiles(values):
  """[min, 25%, median, 75%, max] of `values`."""
  return [float(x) for x in np.percentile(values, [0, 25, 50, 75, 100])]


def describe(task, tokenizer, records, episodes, calls, seconds):
  """What a mode's episodes were (lengths, turns, tool calls, accuracy) and its engine calls
  (`seconds`: the run's time)."""
  policy = [envs.policy_tokens(e) for e in episodes]
  texts = [tokenizer.decode(e.token_ids) for e in episodes]
  rows_steps = sum(c["rows"] * c["steps"] for c in calls)
  return {
      "episodes": len(episodes),
      "policy_tokens": int(sum(policy)),
      "all_tokens": int(sum(len(e.token_ids) for e in episodes)),
      "turns": dict(sorted(collections.Counter(e.turns for e in episodes).items())),
      "policy_tokens_quartiles": quartiles(policy),
      "tool_calls": int(sum(e.counts.get("tool_calls", 0) for e in episodes)),
      "budget_truncated": int(sum(e.budget_truncated for e in episodes)),
      "correct": int(sum(task.verify(t, r) for t, r in zip(texts, records))),
      "engine_calls": len(calls),
      "decode_steps": int(sum(c["steps"] for c in calls)),
      "utilisation": sum(c["tokens"] for c in calls) / max(rows_steps, 1),
      "engine_share": sum(c["seconds"] for c in calls) / seconds,
      "rows_per_call": quartiles([c["rows"] for c in calls]),
  }


def machine():
  """What ran this, for the results file."""
  with open("/proc/cpuinfo") as f:
    cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
               platform.processor())
  try:
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = None
  return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
          "python": platform.python_version(), "jax": jax.__version__,
          "backend": jax.default_backend(), "commit": commit,
          "date": datetime.datetime.now().isoformat(timespec="minutes")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--episodes", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=ROUNDS)
  parser.add_argument("--min_batch", type=int, default=1,
                      help="JaxEngine's smallest batch (rows a lone episode's calls run)")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  tokenizer = CharTokenizer()
  environment = envs.ToolEnvironment(("calc",), max_turns=3, max_turn_tokens=MAX_TURN_TOKENS,
                                     max_result_tokens=32)
  task = ToolArithmetic(Arithmetic(digits=6, operands=2), environment,
                        call_fraction=CALL_FRACTION, call_min_digits=3)
  if args.episodes > len(task.test):
    parser.error(f"--episodes {args.episodes} exceeds the {len(task.test)} test problems")
  started = time.perf_counter()
  cfg, params, sft_loss = trained_policy(task, tokenizer)
  sft_seconds = time.perf_counter() - started
  print(f"SFT: {SFT_STEPS} steps in {sft_seconds:.1f} s, final loss {sft_loss:.3f}")
  engine = CountingEngine(JaxEngine(cfg, params, min_batch=args.min_batch))
  records = [task.test[i] for i in range(args.episodes)]
  prompts = [prompt_ids(task, tokenizer, r) for r in records]
  sampling = SamplingParams(MAX_NEW_TOKENS, temperature=1.0, stop_token_ids=(tokenizer.eos_id,))

  started = time.perf_counter()
  for mode in MODES:  # compiles every shape the timed runs meet
    timed(mode, engine, task, tokenizer, records, prompts, sampling)
  warmup_seconds = time.perf_counter() - started
  seconds = {mode: [] for mode in MODES}
  described = {}
  for round_ in range(args.rounds):
    for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
      episodes, elapsed, calls = timed(mode, engine, task, tokenizer, records, prompts,
                                       sampling)
      seconds[mode].append(elapsed)
      described[mode] = describe(task, tokenizer, records, episodes, calls, elapsed)
  environment.close()

  results = {}
  for mode in MODES:
    d, total = described[mode], sum(seconds[mode])
    results[mode] = dict(d, seconds=seconds[mode],
                         episodes_per_second=d["episodes"] * args.rounds / total,
                         policy_tokens_per_second=d["policy_tokens"] * args.rounds / total)
  rounds = [one / waves for one, waves in zip(seconds["one_at_a_time"], seconds["waves"])]
  ratio = statistics.median(rounds)
  one, waves = results["one_at_a_time"], results["waves"]
  pooled = waves["episodes_per_second"] / one["episodes_per_second"]
  token_ratio = waves["policy_tokens_per_second"] / one["policy_tokens_per_second"]

  print(f"{args.episodes} episodes, {args.rounds} rounds; warm-up (compiles) "
        f"{warmup_seconds:.1f} s")
  header = (f"{'mode':>14} {'episodes/s':>10} {'policy tok/s':>12} {'s/round':>8} "
            f"{'calls':>6} {'steps':>6} {'util':>5} {'engine':>6} {'turns 1/2/3':>12} "
            f"{'policy tokens min/med/max':>26} {'correct':>7}")
  print(header)
  for mode in MODES:
    r = results[mode]
    turns = "/".join(str(r["turns"].get(k, 0)) for k in (1, 2, 3))
    q = r["policy_tokens_quartiles"]
    print(f"{mode:>14} {r['episodes_per_second']:>10.1f} "
          f"{r['policy_tokens_per_second']:>12.0f} {statistics.median(r['seconds']):>8.3f} "
          f"{r['engine_calls']:>6} {r['decode_steps']:>6} {r['utilisation']:>5.2f} "
          f"{r['engine_share']:>6.0%} "
          f"{turns:>12} {f'{q[0]:.0f}/{q[2]:.0f}/{q[4]:.0f}':>26} "
          f"{r['correct']:>4}/{r['episodes']}")
  print(f"waves / one at a time per round: {', '.join(f'{x:.2f}' for x in rounds)}; pooled "
        f"{pooled:.2f}; policy tokens/s {token_ratio:.2f}")
  print(f"waves / one at a time = {ratio:.2f} episodes/s, the median round (target >= 3)")

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "agentic.json"), "w") as f:
    json.dump({"results": results, "ratio": ratio, "rounds": rounds, "pooled": pooled,
               "policy_tokens_ratio": token_ratio, "episodes": args.episodes,
               "sft_steps": SFT_STEPS, "sft_seconds": sft_seconds, "sft_loss": sft_loss,
               "warmup_seconds": warmup_seconds, "call_fraction": CALL_FRACTION,
               "max_new_tokens": MAX_NEW_TOKENS, "max_turn_tokens": MAX_TURN_TOKENS,
               "seq_len": SEQ_LEN, "min_batch": args.min_batch, "machine": machine()}, f, indent=2)


if __name__ == "__main__":
  main()
