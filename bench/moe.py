"""A mixture-of-experts train step against the dense model of the same active parameters, on
this machine. Not a test.

  python bench/moe.py [--rounds 10] [--out bench/results]

Decoders alike but for their MLPs: the dense one's SwiGLU of width k * S; the mixture's E
experts of width S of which each token takes k (Qwen3-MoE's block, a softmax router), so a
token meets as many MLP weights in both, run dropless (grouped matrix products,
jax.lax.ragged_dot) and with a capacity factor of CAPACITY (MoeConfig.capacity_factor); the
mixture holds E / k times the MLP parameters, and its router. One k1.5 train step each
(forward, chunked log-probs, loss, backward, AdamW) on the same packed rows, compiled in one
process and timed in turns, the order rotating, with a pause before each. Prints and writes
the median time of each, each mixture's ratio to the dense step, and each compiled step's
temporary memory (XLA's memory analysis).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTLE_S = 0.5
CAPACITY = 1.25
SHAPE = {"vocab": 4096, "hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2,
         "experts": 16, "k": 2, "expert_size": 256, "rows": 8, "seq": 512}


def configs() -> dict:
  """name -> ModelConfig of SHAPE (dense, dropless, capacity): the same attention, MLPs of
  the same active width."""
  from models.config import ModelConfig, MoeConfig
  s = SHAPE
  common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"],
                num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                head_dim=s["hidden"] // s["heads"], qkv_bias=False, tie_embeddings=False)
  active = s["k"] * s["expert_size"]
  dense = ModelConfig(family="qwen3", intermediate_size=active, **common)
  moe = MoeConfig(num_experts=s["experts"], experts_per_token=s["k"],
                  expert_size=s["expert_size"], normalize_weights=True)
  mixture = lambda moe: ModelConfig(family="qwen3_moe", intermediate_size=active, moe=moe,
                                    **common)
  return {"dense": dense, "dropless": mixture(moe),
          f"capacity {CAPACITY}": mixture(dataclasses.replace(moe, capacity_factor=CAPACITY))}


def batch():
  """SHAPE's packed rows: random tokens, two segments a row, the second half of each
  segment a completion with random advantages."""
  import jax.numpy as jnp
  import numpy as np
  from rl.types import TrainBatch
  rows, seq = SHAPE["rows"], SHAPE["seq"]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, SHAPE["vocab"], (rows, seq), dtype=np.int32)
  half = seq // 2
  positions = np.tile(np.concatenate([np.arange(half), np.arange(half)]), (rows, 1))
  segments = np.tile(np.repeat([1, 2], half), (rows, 1)).astype(np.int32)
  mask = (positions >= half // 2).astype(np.float32)
  return TrainBatch(tokens=jnp.asarray(tokens), targets=jnp.asarray(np.roll(tokens, -1, 1)),
                    positions=jnp.asarray(positions, jnp.int32), segment_ids=jnp.asarray(segments),
                    loss_mask=jnp.asarray(mask), old_logp=jnp.full((rows, seq), -8.0),
                    advantages=jnp.asarray(rng.normal(size=(rows, seq)), jnp.float32))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  from models import host_allocator
  host_allocator.keep_freed_memory()  # as experiments/run.py does, before JAX starts
  import jax
  import optax
  from models import transformer
  from rl import losses
  from rl.train_step import init_train_state, make_train_step

  train_batch = batch()
  optimizer = optax.adamw(1e-5)
  steps, states, info = {}, {}, {}
  for name, cfg in configs().items():
    params = transformer.init_params(cfg, jax.random.PRNGKey(0))
    states[name] = init_train_state(params, optimizer)
    steps[name] = make_train_step(cfg, optimizer, losses.bind("k1.5"), logprob_chunk=1024)
    memory = steps[name].lower(states[name], train_batch).compile().memory_analysis()
    info[name] = {"params": int(sum(x.size for x in jax.tree.leaves(params))),
                  "temp_gib": memory.temp_size_in_bytes / 2**30}
    jax.block_until_ready(steps[name](states[name], train_batch))  # compile and warm up
  seconds = {name: [] for name in steps}
  names = list(steps)
  for turn in range(args.rounds):
    for name in names[turn % len(names):] + names[:turn % len(names)]:
      time.sleep(SETTLE_S)
      started = time.perf_counter()
      jax.block_until_ready(steps[name](states[name], train_batch))
      seconds[name].append(time.perf_counter() - started)
  median = {name: statistics.median(s) for name, s in seconds.items()}
  ratio = {name: median[name] / median["dense"] for name in steps}
  tokens = SHAPE["rows"] * SHAPE["seq"]
  print(f"{'model':14s}{'params':>12s}{'step (median)':>16s}{'x dense':>9s}{'tokens/s':>10s}"
        f"{'temp memory':>14s}")
  for name in steps:
    print(f"{name:14s}{info[name]['params']:12,d}{median[name]:14.3f} s{ratio[name]:8.2f}x"
          f"{tokens / median[name]:10.0f}{info[name]['temp_gib']:10.3f} GiB")
  print(f"same active parameters: {SHAPE['experts']} experts of width {SHAPE['expert_size']}, "
        f"{SHAPE['k']} a token, against one MLP of width {SHAPE['k'] * SHAPE['expert_size']}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "moe.json"), "w") as f:
    json.dump({"shape": SHAPE, "seconds": seconds, "median_s": median, "ratio": ratio,
               "models": info}, f, indent=1)


if __name__ == "__main__":
  main()
