"""Peak RSS of RL steps with a copying vs a donating train step. Not a test.

  python bench/loop_memory.py [--steps 6] [--out bench/results]

`rl.loop.rl_steps` on the embedded engine with an 8-layer, width-512 model (8 heads over 2
KV heads, intermediate 1408: the peer config of bench/peers.py with the character
vocabulary) on one-digit arithmetic: 4 prompts x 8 samples of up to 16 tokens, two
minibatches per step, GRPO. Each kind of train step runs in its own process (peak RSS is per
process and never goes down), which reports its peak RSS after every RL step.
`rl.trainer.train` uses the donating one.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(donate: bool, steps: int) -> list[float]:
  """Peak RSS in bytes after each of `steps` RL steps, in this process."""
  sys.path.insert(0, ROOT)
  from models import host_allocator
  host_allocator.keep_freed_memory()  # as experiments/run.py does, before JAX starts
  import jax
  from models import config, transformer
  from models.tokenizer import CharTokenizer
  from rl import loop, losses, rewards, sampling, sources
  from rl.config import RLConfig
  from rl.tasks.arithmetic import Arithmetic
  from rl.train_step import make_train_step
  from rollouts.jax_engine import JaxEngine

  tokenizer = CharTokenizer()
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=512, num_layers=8, num_heads=8,
                    num_kv_heads=2, intermediate_size=1408)
  optimizer = loop.rl_optimizer(1e-4)
  rl = RLConfig(prompts_per_step=4, samples_per_prompt=8, max_new_tokens=16, seq_len=32,
                minibatches=2)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  loss = losses.bind("grpo", {"kl_coef": 0.0})
  parts = loop.Parts(
      sources.Context(JaxEngine(cfg, params), Arithmetic(digits=1, num_train=64, num_test=8),
                      tokenizer, rl, sampling.uniform()),
      sources.Lockstep(), loss, make_train_step(cfg, optimizer, loss, donate_state=donate),
      rewards.named_chain({"correctness": rewards.correctness()}), losses.get("grpo").advantage)
  rl_steps = loop.rl_steps(loop.init_state(params, optimizer, parts, 0), parts)
  del params  # the generator holds the state; a name here would keep the first one alive
  peaks = []
  for _ in range(steps):
    next(rl_steps)
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  return peaks


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--child", choices=["copy", "donate"], help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(run(args.child == "donate", args.steps)))
    return
  results = {}
  for kind in ("copy", "donate"):
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(args.steps)],
                         check=True, capture_output=True, text=True).stdout
    results[kind] = json.loads(out.strip().splitlines()[-1])
    print(f"{kind:>7} train step: peak RSS after each RL step (GiB) "
          + " ".join(f"{b / 2**30:.2f}" for b in results[kind]), flush=True)
  print(f"donated / copying, after {args.steps} steps: "
        f"{results['donate'][-1] / results['copy'][-1]:.2f}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "loop_memory.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
