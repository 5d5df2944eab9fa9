"""The peer-config train step with RoPE from cos/sin tables (models/rope.py) vs RoPE
computed as cos and sin of position x frequency in the step. Not a test.

  python bench/rope.py [--rounds 20] [--out bench/results]

Both steps are compiled in one process (bench/peers.py's config, batch and GRPO loss) and
timed in turns, the order alternating, with a pause before each; the speedup is the median
over turns of computed / tables. Computed in the step, XLA fuses cos and sin into every
consumer and evaluates them per head, forward and backward.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peers  # noqa: E402


def computed_rope(inv_freq):
  """transformer.rope's contract, with cos and sin computed from float32 angles in the step."""
  import jax.numpy as jnp

  def rope(x, positions, tables):
    del tables
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)

  return rope


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  from models import host_allocator
  host_allocator.keep_freed_memory()  # as experiments/run.py does, before JAX starts
  import jax
  from models import rope as rope_lib
  from models import transformer
  from rl import losses
  from rl.train_step import make_train_step

  cfg, optimizer, state, batch = peers.ours_setup()
  loss = losses.bind("grpo", {"kl_coef": 0.0})
  tables_rope = transformer.rope  # the name the decoder's attention reads
  steps = {}
  for name, rope in (("computed", computed_rope(rope_lib.rope_frequencies(
      cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))), ("tables", tables_rope)):
    transformer.rope = rope  # read when the step is traced, on its first call
    steps[name] = make_train_step(cfg, optimizer, loss, logprob_chunk=1024)
    jax.block_until_ready(steps[name](state, batch))
  transformer.rope = tables_rope
  seconds = {name: [] for name in steps}
  for turn in range(args.rounds):
    for name in (list(steps) if turn % 2 == 0 else list(steps)[::-1]):
      time.sleep(peers.SETTLE_S)
      started = time.perf_counter()
      jax.block_until_ready(steps[name](state, batch))
      seconds[name].append(time.perf_counter() - started)
  ratios = [c / t for c, t in zip(seconds["computed"], seconds["tables"])]
  faster = sum(r > 1 for r in ratios)
  print(f"fastest step: computed {min(seconds['computed']):.2f} s, tables "
        f"{min(seconds['tables']):.2f} s; tables faster by {statistics.median(ratios):.3f}x at "
        f"the median ({min(ratios):.2f}-{max(ratios):.2f}, {faster} of {len(ratios)} turns)")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "rope.json"), "w") as f:
    json.dump({"seconds": seconds, "ratios": ratios, "speedup": statistics.median(ratios)}, f,
              indent=1)


if __name__ == "__main__":
  main()
