"""Serving a LoRA policy merged against unmerged, on this machine. Not a test.

  python bench/lora_serving.py [--shapes quickstart,qwen2.5-0.5b] [--rank 32] [--rounds 3]
                               [--out bench/results]

(writes bench/results/lora_serving.json)

Our engines (the embedded one and our server) serve a LoRA run's policy merged: at each sync
models/lora.merged writes W + (alpha / r) A B into a copy of the weights, and decoding runs on
plain weights. Unmerged, decoding would run on lora.attach(base, adapters) (the projections
add the low-rank product to every token's, as SGLang does). This times both: the merge, and
rollouts.decoding.sample of one batch on merged weights against on attached ones (no stop
token: every row decodes max_new tokens, temperature 1), the fastest of --rounds each, in turn.
  quickstart    the quickstart's model and step: 256 rows (32 prompts x 8), prompts of 16
                tokens, 40 new tokens, float32
  qwen2.5-0.5b  bench/memory.py's Qwen2.5-0.5B shape in bf16 (as the engine serves it), 8 rows,
                prompts of 64 tokens, 64 new tokens
LoRA adapts every projection at --rank, alpha = rank (random A and B: the timing does not
depend on their values). XLA:CPU on this machine's cores.
"""

import argparse
import dataclasses
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
from rollouts import decoding  # noqa: E402

SHAPES = {  # name -> (model config, rows, prompt tokens, new tokens)
    "quickstart": (lambda: config.tiny(CharTokenizer().vocab_size), 256, 16, 40),
    "qwen2.5-0.5b": (lambda: hf.config_from_hf(CONFIGS["qwen2.5-0.5b"], dtype="bfloat16",
                                               param_dtype="bfloat16"), 8, 64, 64),
}


def _fastest(fn, rounds: int) -> float:
  fn()  # compiles
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def measure(name: str, rank: int, rounds: int) -> dict:
  make_cfg, rows, prompt, max_new = SHAPES[name]
  cfg = make_cfg()
  base = transformer.init_params(cfg, jax.random.PRNGKey(0))
  adapters = lora.init_adapters(base, lora.LoraConfig(rank=rank, alpha=float(rank)), cfg,
                                jax.random.PRNGKey(1))
  # init_adapters zeroes B (the usual start); random B so that the merge is not a copy.
  adapters = jax.tree.map(
      lambda x: dataclasses.replace(x, b=0.01 * jax.random.normal(jax.random.PRNGKey(2),
                                                                  x.b.shape)),
      adapters, is_leaf=lambda x: isinstance(x, lora.Adapter))
  prompts = jax.random.randint(jax.random.PRNGKey(3), (rows, prompt), 3, cfg.vocab_size,
                               jnp.int32)
  lengths = jnp.full((rows,), prompt, jnp.int32)

  def decode(params):
    out = decoding.sample(params, prompts, lengths, jax.random.PRNGKey(4), jnp.float32(1.0),
                          jnp.float32(1.0), cfg=cfg, max_new=max_new, stop_ids=())
    jax.block_until_ready(out)

  merged = lora.merged(base, adapters)
  attached = lora.attach(base, adapters)
  merge_s = _fastest(lambda: jax.block_until_ready(lora.merged(base, adapters)), rounds)
  decode_merged_s = _fastest(lambda: decode(merged), rounds)
  decode_attached_s = _fastest(lambda: decode(attached), rounds)
  tokens = rows * max_new
  return {"shape": name, "rows": rows, "prompt": prompt, "max_new": max_new, "rank": rank,
          "merge_s": merge_s, "decode_merged_s": decode_merged_s,
          "decode_attached_s": decode_attached_s,
          "merged_tokens_per_s": tokens / decode_merged_s,
          "attached_tokens_per_s": tokens / decode_attached_s,
          "attached_over_merged": decode_attached_s / decode_merged_s}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  print(f"{'shape':<14}{'rank':>5}{'merge s':>9}{'merged s':>10}{'unmerged s':>12}"
        f"{'unmerged / merged':>19}")
  results = []
  for name in args.shapes.split(","):
    r = measure(name, args.rank, args.rounds)
    results.append(r)
    print(f"{name:<14}{r['rank']:>5}{r['merge_s']:>9.3f}{r['decode_merged_s']:>10.3f}"
          f"{r['decode_attached_s']:>12.3f}{r['attached_over_merged']:>19.2f}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lora_serving.json"), "w") as f:
    json.dump({"rounds": args.rounds, "devices": [str(d) for d in jax.devices()],
               "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
