"""Peak memory of per-token log-probs (forward + backward) at a real vocabulary: chunked
(models/logprobs.py) vs the naive full-logits computation. Not a test.

  python bench/logprobs.py [--out bench/results]

Vocabulary 151,936 (Qwen2.5), width 896 (Qwen2.5-0.5B), fp32, at 8k and 32k tokens. Peak
memory is the compiled executable's (XLA memory analysis: arguments + outputs + temporaries);
a naive call needing more than this machine's RAM is reported and not run. Time is one warm
call of the forward and backward pass.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import logprobs  # noqa: E402

VOCAB, WIDTH = 151_936, 896
GiB = 2 ** 30


def naive(hidden, unembed, targets):
  logits = hidden @ unembed
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, entropy


def chunked(hidden, unembed, targets):
  return logprobs.token_logprobs(hidden, unembed, targets, chunk_size=2048)


def measure(fn, tokens):
  def loss(hidden, unembed, targets):
    logp, entropy = fn(hidden, unembed, targets)
    return jnp.sum(logp) + 0.01 * jnp.sum(entropy)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  shapes = (jax.ShapeDtypeStruct((1, tokens, WIDTH), jnp.float32),
            jax.ShapeDtypeStruct((WIDTH, VOCAB), jnp.float32),
            jax.ShapeDtypeStruct((1, tokens), jnp.int32))
  compiled = grad.lower(*shapes).compile()
  m = compiled.memory_analysis()
  peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
  row = {"kind": fn.__name__, "tokens": tokens, "peak_bytes": peak, "seconds": None}
  machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if peak > 0.8 * machine:
    row["note"] = f"does not fit: needs {peak / GiB:.1f} GiB of {machine / GiB:.0f}"
    return row
  args = (jnp.zeros((1, tokens, WIDTH)), jnp.full((WIDTH, VOCAB), 0.01),
          jnp.zeros((1, tokens), jnp.int32))
  jax.block_until_ready(compiled(*args))
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  row["seconds"] = time.perf_counter() - start
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  rows = []
  print(f"log-probs + entropy, forward + backward, vocab {VOCAB}, width {WIDTH}, fp32")
  print(f"{'tokens':>7} {'kind':>8} {'peak memory':>12} {'time':>10}")
  for tokens in (8192, 32768):
    for fn in (naive, chunked):
      row = measure(fn, tokens)
      rows.append(row)
      t = f"{row['seconds']:.1f} s" if row["seconds"] is not None else row["note"]
      print(f"{tokens:>7} {row['kind']:>8} {row['peak_bytes'] / GiB:>8.2f} GiB {t:>10}", flush=True)
  for tokens in (8192, 32768):
    pair = {r["kind"]: r["peak_bytes"] for r in rows if r["tokens"] == tokens}
    print(f"{tokens} tokens: chunked uses {pair['chunked'] / pair['naive']:.3f} of naive's memory")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "logprobs.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
