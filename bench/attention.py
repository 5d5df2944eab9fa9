"""Attention benchmarks on this machine (not tests): memory and time of every kernel that runs
here, and of ring attention.

  python bench/attention.py [--parts kernels,ring,balance,train_step] [--lengths 4096,...]
                            [--out bench/results]

kernels     causal attention forward+backward at 4k, 16k, 32k, 64k and 128k tokens (one row),
            every kernel of models/attention/dispatch.py that runs on this backend: dense and
            blockwise everywhere, plus cpu (the C++ kernel) on CPU, cudnn and pallas_gpu on a
            GPU, splash on a TPU; float32 on CPU, bfloat16 on accelerators (their kernels take
            half precision only). The compiled executable's peak memory (arguments + outputs +
            temporaries, from XLA's memory analysis; for cpu plus the kernel's own scratch,
            which XLA does not see: per thread, the dk and dv rows of one KV head, 2 x seq x
            head_dim floats, and its block buffers), the wall time of one warm call and the
            TFLOP/s that makes (forward + backward counted as 3.5 forwards of the visible
            pairs' two products). A call whose memory exceeds the machine's (RAM on CPU, the
            device's memory elsewhere) is reported as not fitting and is not run.
ring        ring attention forward+backward at context=8 (8 simulated CPU devices): the
            per-device temporary memory (from the compiled executable's memory analysis)
            against the single-device blockwise figure at the same length, and the time of one
            warm call over blockwise tiles and over the C++ kernel (the 8 devices share this
            machine's cores: a comparison of the chunk kernels, not a speed-up).
balance     attention work per device under the zigzag layout vs a contiguous split: visible
            (query, key) pairs and computed tiles (the blockwise kernel skips empty tiles).
train_step  one full train step (forward, chunked log-probs, k1.5 loss, backward, AdamW) of a
            4-layer, width-256 model on one packed 32,768-token row: peak RSS and time.

Each part runs in its own process so that peak RSS and the simulated device count are its own.
Results go to OUT/attention.json and are printed as a table.
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
sys.path.insert(0, ROOT)

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
LENGTHS = tuple(int(n) for n in os.environ.get("LONGRL_BENCH_LENGTHS",
                                                "4096,16384,32768,65536,131072").split(","))
GiB = 2 ** 30


def _machine_bytes():
  """What one call may use: this machine's RAM on CPU, the device's memory elsewhere."""
  import jax
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
  if stats and "bytes_limit" in stats:
    return stats["bytes_limit"]
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _kernels():
  """(kernels that run on this backend, the dtype they are timed in)."""
  import jax
  import jax.numpy as jnp
  from models.attention import dispatch

  here = []
  for kernel in ("cpu", "cudnn", "pallas_gpu", "splash"):
    try:
      dispatch.resolve(kernel, jax.default_backend())
    except dispatch.KernelUnavailable:
      continue
    here.append(kernel)
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return ["dense", "blockwise", *here], dtype


def _attention_grad(kind, seq, block=256, mesh=None, dtype=None):
  """(jitted fn, args): attention forward and the backward pass of a given output cotangent
  (as in a model, where it comes from the layers above) -> (dq, dk, dv), for one row.

  With `mesh`, the arguments are sequence-sharded over its `context` axis and the kind is
  ring attention ("ring" over blockwise tiles, "ring_cpu" over the C++ kernel)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from models.attention import blockwise, cpu, dispatch, reference, ring

  sharded = None if mesh is None else NamedSharding(mesh, P(None, "context"))
  arg = lambda shape, dtype=dtype or jnp.float32: jax.ShapeDtypeStruct(shape, dtype,
                                                                      sharding=sharded)
  q = arg((1, seq, HEADS, HEAD_DIM))
  kv = arg((1, seq, KV_HEADS, HEAD_DIM))
  seg = arg((1, seq), jnp.int32)
  attend = {
      "dense": lambda q, k, v, s: reference.attention(q, k, v, reference.segment_causal_mask(s)),
      "blockwise": lambda q, k, v, s: blockwise.attention(q, k, v, s, block_q=block,
                                                          block_k=block),
      "ring": lambda q, k, v, s: ring.attention(q, k, v, s, block_q=block, block_k=block),
      "ring_cpu": lambda q, k, v, s: ring.attention(q, k, v, s, chunks="cpu"),
      "cpu": cpu.attention,
      "cudnn": dispatch.cudnn_attention,
      "pallas_gpu": dispatch.pallas_gpu_attention,
      "splash": dispatch.splash_attention,
  }[kind]

  def forward_backward(q, k, v, seg, cotangent):
    _, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
    return pullback(cotangent)

  out_shardings = None if mesh is None else (sharded,) * 3
  return jax.jit(forward_backward, out_shardings=out_shardings), (q, kv, kv, seg, q)


def _concrete(args):
  """Arrays for the abstract `args` (placed as their shardings say): zeros, and segment ids of
  1 (one document)."""
  import jax
  import jax.numpy as jnp
  make = lambda a: jnp.ones(a.shape, a.dtype) if a.dtype == jnp.int32 else jnp.zeros(a.shape,
                                                                                       a.dtype)
  return [make(a) if a.sharding is None else jax.device_put(make(a), a.sharding) for a in args]


def _peak_bytes(compiled):
  m = compiled.memory_analysis()
  return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _cpu_scratch_bytes(seq):
  """The C++ kernel's thread-local buffers at their largest (cpu_attention.cc:
  BackwardScratch): per thread, dk and dv for one KV head over the row, and the blocks of one
  work item."""
  group = HEADS // KV_HEADS
  rows, keys = group * max(16, min(64, 128 // group)), 64  # query rows of a block; its keys
  per_thread = 4 * (2 * seq * HEAD_DIM + 3 * rows * HEAD_DIM + 2 * rows * keys
                    + 3 * keys * HEAD_DIM)
  return os.cpu_count() * per_thread


def _causal_flops(seq):
  """Forward + backward FLOPs of causal attention over one row: two products per visible
  (query, key) pair and head, the backward counted as 2.5 forwards."""
  return 3.5 * 2 * 2 * HEADS * HEAD_DIM * seq * (seq + 1) / 2


def _warm_seconds(compiled, args):
  import jax
  jax.block_until_ready(compiled(*args))  # warm
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  return time.perf_counter() - start


def part_kernels():
  import jax
  kernels, dtype = _kernels()
  rows = []
  for seq in LENGTHS:
    for kind in kernels:
      fn, shapes = _attention_grad(kind, seq, dtype=dtype)
      compiled = fn.lower(*shapes).compile()
      peak = _peak_bytes(compiled) + (_cpu_scratch_bytes(seq) if kind == "cpu" else 0)
      row = {"kind": kind, "seq": seq, "dtype": str(shapes[0].dtype), "peak_bytes": peak,
             "backend": jax.default_backend()}
      if peak > 0.8 * _machine_bytes():
        row["seconds"] = None
        row["note"] = f"does not fit: needs {peak / GiB:.1f} GiB of {_machine_bytes() / GiB:.0f}"
      else:
        row["seconds"] = _warm_seconds(compiled, _concrete(shapes))
        row["tflops"] = _causal_flops(seq) / row["seconds"] / 1e12
      rows.append(row)
      print(row, flush=True)
  return rows


def part_ring():
  import jax
  from models import sharding

  rows = []
  mesh = sharding.make_mesh(context=8)
  for seq in (16384, 65536, 131072):
    single, shapes = _attention_grad("blockwise", seq)
    single_temp = single.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    row = {"seq": seq, "context": 8, "single_device_temp_bytes": single_temp}
    for kind, chunks in (("ring", "blockwise"), ("ring_cpu", "cpu")):
      ring_fn, shapes = _attention_grad(kind, seq, mesh=mesh)
      with jax.set_mesh(mesh):
        compiled = ring_fn.lower(*shapes).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes  # per device
        row[f"{chunks}_per_device_temp_bytes"] = temp
        row[f"{chunks}_ratio"] = temp / single_temp
        if seq <= 65536:
          row[f"{chunks}_seconds"] = _warm_seconds(compiled, _concrete(shapes))
    rows.append(row)
    print(rows[-1], flush=True)
  return rows


def part_balance():
  import numpy as np
  from models.attention import ring

  seq, context, block = 65536, 8, 256
  rows = []
  for layout, order in (("zigzag", ring.zigzag_order(seq, context)),
                        ("contiguous", np.arange(seq))):
    pairs, tiles = [], []
    for shard in order.reshape(context, -1):
      pairs.append(int(np.sum(shard + 1)))  # query at position p sees p + 1 keys
      q_tiles = shard.reshape(-1, block)
      kv_tiles = np.arange(seq).reshape(-1, block)
      tiles.append(int(np.sum(kv_tiles.min(1)[None, :] <= q_tiles.max(1)[:, None])))
    rows.append({"layout": layout, "pairs_per_device": pairs, "tiles_per_device": tiles,
                 "pairs_spread": (max(pairs) - min(pairs)) / min(pairs),
                 "tiles_spread": (max(tiles) - min(tiles)) / min(tiles)})
    print(rows[-1], flush=True)
  return rows


def part_train_step():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import config, transformer
  from rl import losses
  from rl.loop import rl_optimizer
  from rl.train_step import init_train_state, make_train_step
  from rl.types import TrainBatch

  seq, vocab = 32768, 8192
  cfg = config.tiny(vocab, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=704)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  optimizer = rl_optimizer(1e-5)
  state = init_train_state(params, optimizer)
  # One row packed with 16 trajectories of 2,048 tokens; loss on every real token.
  seg = np.repeat(np.arange(1, 17), seq // 16)[None].astype(np.int32)
  pos = np.tile(np.arange(seq // 16), 16)[None].astype(np.int32)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, vocab, (1, seq)).astype(np.int32)
  batch = TrainBatch(tokens=jnp.asarray(tokens), targets=jnp.asarray(np.roll(tokens, -1, 1)),
                     positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg),
                     loss_mask=jnp.ones((1, seq), jnp.float32),
                     old_logp=jnp.full((1, seq), -9.0, jnp.float32),
                     advantages=jnp.asarray(rng.normal(size=(1, seq)), jnp.float32))
  step = make_train_step(cfg, optimizer, losses.bind("k1.5", None))
  compiled_peak = _peak_bytes(step.lower(state, batch).compile())
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  first = time.perf_counter() - start
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  row = {"seq": seq, "layers": 4, "width": 256, "vocab": vocab,
         "compiled_peak_bytes": compiled_peak,
         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
         "first_step_seconds_incl_compile": first, "step_seconds": time.perf_counter() - start,
         "loss": float(metrics["loss"]), "machine_bytes": _machine_bytes()}
  print(row, flush=True)
  return [row]


PARTS = {"kernels": part_kernels, "ring": part_ring, "balance": part_balance,
         "train_step": part_train_step}


def _table(results):
  lines = []
  if "kernels" in results:
    rows = results["kernels"]
    lines += [f"attention fwd+bwd (1 row, 8 heads over 2 KV heads, head_dim 64, causal, "
              f"{rows[0]['dtype']}, {rows[0]['backend']})",
              f"{'seq':>7} {'kernel':>10} {'peak memory':>14} {'time':>9} {'TFLOP/s':>8}"]
    for r in rows:
      t = (f"{r['seconds']:>7.2f} s {r['tflops']:>8.3f}" if r["seconds"] is not None
           else r["note"])
      lines.append(f"{r['seq']:>7} {r['kind']:>10} {r['peak_bytes'] / GiB:>10.3f} GiB {t:>9}")
    by = lambda kind, key: {r["seq"]: r[key] for r in rows if r["kind"] == kind}
    lengths = sorted(by("blockwise", "seq"))
    for kind in dict.fromkeys(r["kind"] for r in rows if r["kind"] != "dense"):
      mem = by(kind, "peak_bytes")
      lines.append(f"{kind} memory ratio {lengths[-1]}/{lengths[0]} = "
                   f"{mem[lengths[-1]] / mem[lengths[0]]:.1f} for "
                   f"{lengths[-1] / lengths[0]:.0f}x the tokens (linear: {lengths[-1] / lengths[0]:.0f})")
  if "ring" in results:
    for r in results["ring"]:
      times = ", ".join(f"{chunks} {r[f'{chunks}_seconds']:.2f} s" for chunks in ("blockwise", "cpu")
                        if f"{chunks}_seconds" in r)
      lines.append(f"ring context=8 at {r['seq']}: per-device temp over blockwise tiles "
                   f"{r['blockwise_per_device_temp_bytes'] / 2**20:.1f} MiB, over the C++ kernel "
                   f"{r['cpu_per_device_temp_bytes'] / 2**20:.1f} MiB, vs single-device blockwise "
                   f"{r['single_device_temp_bytes'] / 2**20:.1f} MiB: ratios "
                   f"{r['blockwise_ratio']:.3f}, {r['cpu_ratio']:.3f} (target <= 0.167)"
                   + (f"; fwd+bwd {times}" if times else ""))
  if "balance" in results:
    for r in results["balance"]:
      lines.append(f"{r['layout']:>10} layout, 64k over 8 devices: visible-pair spread "
                   f"{100 * r['pairs_spread']:.1f}%, computed-tile spread "
                   f"{100 * r['tiles_spread']:.1f}% (target <= 5% for zigzag)")
  if "train_step" in results:
    r = results["train_step"][0]
    lines.append(f"train step, 4 layers x 256, one packed {r['seq']}-token row, vocab "
                 f"{r['vocab']}: peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB (compiled "
                 f"{r['compiled_peak_bytes'] / GiB:.2f} GiB) of "
                 f"{r['machine_bytes'] / GiB:.0f} GiB, {r['step_seconds']:.1f} s/step")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default=",".join(PARTS))
  parser.add_argument("--lengths", help="kernels part: tokens per row, comma-separated "
                      f"(default {','.join(map(str, LENGTHS))})")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--_part", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._part:  # child process: one part, its rows printed as they come, JSON to a file
    part, out = args._part
    rows = PARTS[part]()
    with open(out, "w") as f:
      json.dump(rows, f)
    return
  results = {}
  for part in args.parts.split(","):
    if part not in PARTS:
      parser.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
    env = dict(os.environ)
    if args.lengths:
      env["LONGRL_BENCH_LENGTHS"] = args.lengths
    if part == "ring":
      env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    print(f"== {part}", flush=True)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
      proc = subprocess.run([sys.executable, __file__, "--_part", part, result.name], env=env)
      if proc.returncode:
        raise SystemExit(f"bench part {part!r} failed (exit {proc.returncode})")
      results[part] = json.load(result)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "attention.json")
  previous = json.load(open(path)) if os.path.exists(path) else {}
  with open(path, "w") as f:
    json.dump({**previous, **results}, f, indent=1)
  print(_table(results))
  print(f"results: {path}")


if __name__ == "__main__":
  main()
