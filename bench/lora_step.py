"""The train step of a LoRA run against full fine-tuning's, on this machine. Not a test.

  python bench/lora_step.py [--shapes quickstart,qwen2.5-0.5b] [--rank 32] [--rounds 3]
                            [--out bench/results]

(writes bench/results/lora_step.json)

One step = rl.train_step.make_train_step's jitted step (the quickstart's k1.5 loss, AdamW after
a global-norm clip, the state donated) on one batch of random tokens, every token in the loss:
  quickstart    the quickstart's model (tiny: width 128, 2 layers, the character vocabulary)
                at its step's 256 rows of 128 tokens (32 prompts x 8 samples, unpacked)
  qwen2.5-0.5b  bench/memory.py's Qwen2.5-0.5B shape (random float32 master weights, bf16
                compute) at 4 rows of 512 tokens
LoRA adapts every projection at --rank, alpha = rank, over the frozen base (state.params the
adapters, the base an argument never donated). Both steps of a shape are compiled in one
process and timed in turn, --rounds times, each keeping its fastest step, so that the machine's
drift hits them alike. XLA:CPU on this machine's cores; a GPU's ratio would differ.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from memory import CONFIGS  # noqa: E402
from models import config, hf, lora, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import loop, losses  # noqa: E402
from rl.train_step import init_train_state, make_train_step  # noqa: E402
from rl.types import TrainBatch  # noqa: E402

SHAPES = {  # name -> (model config, rows, tokens)
    "quickstart": (lambda: config.tiny(CharTokenizer().vocab_size), 256, 128),
    "qwen2.5-0.5b": (lambda: hf.config_from_hf(CONFIGS["qwen2.5-0.5b"], dtype="bfloat16",
                                               param_dtype="float32"), 4, 512),
}


def _batch(cfg, rows: int, tokens: int) -> TrainBatch:
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  ids = jax.random.randint(keys[0], (rows, tokens + 1), 3, cfg.vocab_size, jnp.int32)
  ones = jnp.ones((rows, tokens), jnp.float32)
  return TrainBatch(tokens=ids[:, :-1], targets=ids[:, 1:],
                    positions=jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32),
                                               (rows, tokens)),
                    segment_ids=jnp.ones((rows, tokens), jnp.int32), loss_mask=ones,
                    old_logp=-jnp.log(float(cfg.vocab_size)) * ones,
                    advantages=jax.random.normal(keys[1], (rows, tokens)))


def _runner(cfg, params, batch, rank: int):
  """A zero-argument function running one step (and waiting for it), compiled and warm."""
  optimizer = loop.rl_optimizer(1e-5)
  step = make_train_step(cfg, optimizer, losses.bind("k1.5", {}), donate_state=True)
  trained = params if not rank else lora.init_adapters(
      params, lora.LoraConfig(rank=rank, alpha=float(rank)), cfg, jax.random.PRNGKey(1))
  if not rank:  # the step donates the state: the base must not be its params
    trained = jax.tree.map(jnp.copy, trained)
  holder = [init_train_state(trained, optimizer)]
  extra = () if not rank else (None, params)

  def run():
    holder[0], metrics = step(holder[0], batch, *extra)
    jax.block_until_ready(metrics)
  run()
  return run, lora.count(trained) if rank else sum(x.size for x in jax.tree.leaves(params))


def measure(name: str, rank: int, rounds: int) -> dict:
  make_cfg, rows, tokens = SHAPES[name]
  cfg = make_cfg()
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  batch = _batch(cfg, rows, tokens)
  runs = {}
  for arm, r in (("full", 0), ("lora", rank)):
    runs[arm] = _runner(cfg, params, batch, r)
  best = {arm: float("inf") for arm in runs}
  for _ in range(rounds):
    for arm, (run, _) in runs.items():
      start = time.perf_counter()
      run()
      best[arm] = min(best[arm], time.perf_counter() - start)
  return {"shape": name, "rows": rows, "tokens": tokens, "rank": rank,
          "full_trained": runs["full"][1], "lora_trained": runs["lora"][1],
          "full_s": best["full"], "lora_s": best["lora"],
          "lora_over_full": best["lora"] / best["full"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  print(f"{'shape':<14}{'rows x tokens':>14}{'rank':>6}{'full s':>9}{'lora s':>9}"
        f"{'lora / full':>13}")
  results = []
  for name in args.shapes.split(","):
    r = measure(name, args.rank, args.rounds)
    results.append(r)
    print(f"{name:<14}{r['rows']:>8} x {r['tokens']:<4}{r['rank']:>6}{r['full_s']:>9.3f}"
          f"{r['lora_s']:>9.3f}{r['lora_over_full']:>13.2f}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lora_step.json"), "w") as f:
    json.dump({"rounds": args.rounds, "devices": [str(d) for d in jax.devices()],
               "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
