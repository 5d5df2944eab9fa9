"""K LoRA arms in one run against K runs one after another, on this machine. Not a test.

  python bench/lora_arms.py [--arms 4] [--rounds 3] [--block 3] [--out bench/results]

(writes bench/results/lora_arms.json)

The quickstart's RL step (its model, random weights as the base, synthetic addition, 32
prompts x 8 samples of up to 40 tokens, the k1.5 loss, the embedded engine) with LoRA rank 8
over the frozen base, for --arms arms with seeds and learning rates of their own:
  together  rl/arms.arms_steps: one run, one engine, the arms' updates in one vmapped step
  apart     rl/loop.rl_steps once per arm: K runs, each with its engine, in the same process
            (so that they share compiled programs: compile times are not compared)
After each side's first RL step (compiling), --rounds rounds each of --block steps of the
arms, then --block steps of each of the K runs in turn (each run's steps one after another,
as a run makes them), so that the machine's drift hits both sides alike; of each side, the
median step (the K runs' i-th steps of a round summed). The ratio is apart / together, for the
same K arm-steps. XLA:CPU on this machine's cores.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import config, lora, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import arms, corrections, loop, losses, rewards, sampling, sources  # noqa: E402
from rl.config import RLConfig  # noqa: E402
from rl.tasks.arithmetic import Arithmetic  # noqa: E402
from rl.train_step import make_train_step, policy_logprobs  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402

RANK, ALPHA = 8, 16.0  # experiments/configs/quickstart_lora.gin's


def _parts(cfg, base, tokenizer, optimizer, *, together: bool) -> loop.Parts:
  """The quickstart's loop parts as a LoRA run over `base`, on an embedded engine of its own."""
  rl = RLConfig(prompts_per_step=32, samples_per_prompt=8, max_new_tokens=40, seq_len=128)
  loss = losses.bind("k1.5", {})
  step = make_train_step(cfg, optimizer, loss, donate_state=True, arms=together)
  return loop.Parts(
      sources.Context(JaxEngine(cfg, base), Arithmetic(digits=2, operands=3), tokenizer, rl,
                      sampling.uniform()),
      sources.Lockstep(), loss, lambda train, batch, ref: step(train, batch, ref, base),
      rewards.named_chain({"correctness": rewards.correctness()}), losses.get("k1.5").advantage,
      corrections.keep(),
      trainer_logprobs=jax.jit(lambda p, b: policy_logprobs(lora.attach(base, p), cfg, b)[0]),
      base=base)


def _step_seconds(steps) -> dict:
  """One step of the generator `steps`: its seconds, and of them generating and training (an
  arms step's records share one train_s)."""
  started = time.perf_counter()
  records = next(steps)
  elapsed = time.perf_counter() - started
  records = records if isinstance(records, list) else [records]
  return {"s": elapsed, "generate_s": sum(r.metrics["generate_s"] for r in records),
          "train_s": records[0].metrics["train_s"]}


def measure(k: int, rounds: int, block: int) -> dict:
  tokenizer = CharTokenizer()
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=384)  # the quickstart's
  base = transformer.init_params(cfg, jax.random.PRNGKey(0))
  adapters = [lora.init_adapters(base, lora.LoraConfig(rank=RANK, alpha=ALPHA), cfg,
                                 jax.random.PRNGKey(10 + a)) for a in range(k)]
  rates = [1e-3 * 2 ** a for a in range(k)]
  optimizer = arms.arms_optimizer()
  parts = _parts(cfg, base, tokenizer, optimizer, together=True)
  together = arms.arms_steps(arms.init_arms_state(adapters, rates, list(range(k)), optimizer,
                                                  parts), parts)
  apart = []
  for a in range(k):
    optimizer = loop.rl_optimizer(rates[a])
    parts = _parts(cfg, base, tokenizer, optimizer, together=False)
    apart.append(loop.rl_steps(loop.init_state(adapters[a], optimizer, parts, a), parts))
  for steps in [together, *apart]:
    next(steps)  # compiling
  seconds = {"together": [], "apart": []}
  for _ in range(rounds):
    seconds["together"] += [_step_seconds(together) for _ in range(block)]
    runs = [[_step_seconds(run) for _ in range(block)] for run in apart]
    seconds["apart"] += [{name: sum(run[i][name] for run in runs) for name in runs[0][0]}
                         for i in range(block)]
  for steps in [together, *apart]:
    steps.close()
  result = {"arms": k, "rounds": rounds, "block": block, "rank": RANK}
  for side, per_step in seconds.items():
    result.update({f"{side}_{name}": float(np.median([r[name] for r in per_step]))
                   for name in per_step[0]})
  result["apart_over_together"] = result["apart_s"] / result["together_s"]
  result["train_apart_over_together"] = result["apart_train_s"] / result["together_train_s"]
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--arms", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--block", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  r = measure(args.arms, args.rounds, args.block)
  for side in ("together", "apart"):
    print(f"{side:<9} {r[side + '_s']:7.2f} s a step (generating {r[side + '_generate_s']:5.2f} s, "
          f"training {r[side + '_train_s']:5.2f} s)")
  print(f"{r['arms']} arms, median of {r['rounds'] * r['block']} steps: apart / together "
        f"{r['apart_over_together']:.2f} (training alone {r['train_apart_over_together']:.2f})")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lora_arms.json"), "w") as f:
    json.dump({"devices": [str(d) for d in jax.devices()], "results": [r]}, f, indent=2)


if __name__ == "__main__":
  main()
