"""Per-device memory of the RL train step at real model sizes, compiled and never run. Not a test.

  python bench/memory.py [--models qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b,qwen3-8b]
      [--tokens 4096,16384,32768] [--fsdp 8] [--tensor 1] [--out bench/results]

For each model (the numbers of its config.json, below) and tokens per row, the GRPO train
step of an RL run (rl.train_step.make_train_step: a k3 KL to the reference policy, whose
log-probs the step computes; bf16 compute over float32 master weights and AdamW moments;
every layer rematerialised; log-probs in chunks of 2048 tokens; the state donated) is lowered
and compiled for a host mesh of fsdp x tensor simulated CPU devices with abstract inputs:
no weight is ever materialised. Each data-parallel device trains one row per micro-batch.
Attention is the blockwise kernel (linear memory, as the GPU and TPU kernels are; XLA sees
all of its buffers). XLA's memory analysis of the compiled executable gives one device's
arguments, outputs, aliased (donated) bytes and temporaries: its peak is
arguments + outputs - aliased + temporaries. Beside it, an analytic estimate (`analytic`).
A configuration fits a chip when its peak is at most 90% of the chip's memory (the rest for
the runtime, fragmentation and, on one GPU, nothing else: the rollout engine is not counted).

The CPU compiler fuses and schedules differently from XLA:GPU and XLA:TPU, so the figures are
an estimate of the same program's needs, not a measurement on the chip.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

DEVICES = 8
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from models import hf, sharding, transformer  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from rl import loop, losses  # noqa: E402
from rl.train_step import init_train_state, make_train_step  # noqa: E402
from rl.types import TrainBatch  # noqa: E402

# config.json of each checkpoint on the Hugging Face hub (the fields models/hf.py reads).
CONFIGS = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
                     "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}
CHIPS = {"80 GB GPU": 80e9, "141 GB GPU": 141e9, "16 GB TPU v5e": 16e9}
FIT_FRACTION = 0.9
LOGPROB_CHUNK = 2048


def model_config(name: str) -> ModelConfig:
  return hf.config_from_hf(CONFIGS[name], dtype="bfloat16", param_dtype="float32",
                           attention="blockwise", remat="full")


def param_count(cfg: ModelConfig) -> int:
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  return sum(x.size for x in jax.tree.leaves(shapes))


def analytic(cfg: ModelConfig, tokens: int, mesh_shape: dict[str, int]) -> dict[str, float]:
  """Bytes per device by hand: the sharded float32 state (params, AdamW's two moments), the
  gradients and the reference params; the rematerialised layers' saved inputs (bf16, one per
  layer); one layer's recomputation (q, k, v, attention output, the MLP's three
  intermediates, bf16, split over tensor); and one chunk of log-probs' float32 logits with
  their softmax and gradient."""
  shards = mesh_shape["fsdp"] * mesh_shape["tensor"]
  p = param_count(cfg)
  q = cfg.num_heads * cfg.head_dim
  kv = cfg.num_kv_heads * cfg.head_dim
  per_token_layer = 2 * (cfg.hidden_size * 3 + q * 2 + kv * 2 +
                         3 * cfg.intermediate_size) / mesh_shape["tensor"]
  return {
      "state": 12 * p / shards,
      "gradients": 4 * p / shards,
      "reference": 4 * p / shards,
      "saved_activations": 2 * tokens * cfg.hidden_size * cfg.num_layers,
      "layer_recompute": tokens * per_token_layer,
      "logits": 3 * 4 * LOGPROB_CHUNK * cfg.vocab_size / mesh_shape["tensor"],
  }


def compile_step(cfg: ModelConfig, tokens: int, mesh) -> dict[str, int]:
  """XLA's memory analysis of the compiled train step on `mesh` (one device's bytes)."""
  optimizer = loop.rl_optimizer(1e-6)
  loss = losses.bind("grpo", {})
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, sharding.param_shardings(params, mesh))
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       state, sharding.state_shardings(state, optimizer, mesh))
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  rows_spec = NamedSharding(mesh, sharding.spec((sharding.BATCH, None), (rows, tokens), mesh))

  def field(dtype):
    return jax.ShapeDtypeStruct((rows, tokens), dtype, sharding=rows_spec)

  batch = TrainBatch(tokens=field(jnp.int32), targets=field(jnp.int32),
                     positions=field(jnp.int32), segment_ids=field(jnp.int32),
                     loss_mask=field(jnp.float32), old_logp=field(jnp.float32),
                     advantages=field(jnp.float32))
  step = make_train_step(cfg, optimizer, loss, logprob_chunk=LOGPROB_CHUNK,
                         state_shardings=sharding.state_shardings(state, optimizer, mesh),
                         donate_state=True)
  with jax.set_mesh(mesh):
    compiled = step.lower(state, batch, params).compile()
  m = compiled.memory_analysis()
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
          "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
          "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                   + m.temp_size_in_bytes)}


def fits(peak: float) -> list[str]:
  return [chip for chip, capacity in CHIPS.items() if peak <= FIT_FRACTION * capacity]


def main():
  # Before JAX starts its backend (importing jax does not): the simulated devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={DEVICES}")
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(CONFIGS))
  parser.add_argument("--tokens", default="4096,16384,32768")
  parser.add_argument("--fsdp", type=int, default=8)
  parser.add_argument("--tensor", type=int, default=1)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  if args.fsdp * args.tensor != DEVICES:
    parser.error(f"--fsdp x --tensor must be {DEVICES} (the simulated devices)")
  mesh = sharding.make_mesh(fsdp=args.fsdp, tensor=args.tensor)
  mesh_shape = dict(mesh.shape)
  gib = 2 ** 30
  print(f"RL train step (GRPO, bf16 compute, f32 master weights + AdamW, remat full), mesh "
        f"fsdp={args.fsdp} x tensor={args.tensor}, one row per data-parallel device; bytes "
        "per device")
  print(f"{'model':>13} {'params':>7} {'tokens':>7} {'XLA peak':>10} {'temps':>9} "
        f"{'analytic':>10}  fits (peak <= {FIT_FRACTION:.0%} of the chip)")
  results = []
  for name in args.models.split(","):
    cfg = model_config(name)
    count = param_count(cfg)
    for tokens in (int(t) for t in args.tokens.split(",")):
      started = time.perf_counter()
      xla = compile_step(cfg, tokens, mesh)
      estimate = analytic(cfg, tokens, mesh_shape)
      total = sum(estimate.values())
      row = {"model": name, "params": count, "tokens": tokens, "mesh": mesh_shape, **xla,
             "analytic": estimate, "analytic_total": total, "fits": fits(xla["peak"]),
             "compile_s": time.perf_counter() - started, "config": dataclasses.asdict(cfg)}
      results.append(row)
      print(f"{name:>13} {count / 1e9:6.2f}B {tokens:>7} {xla['peak'] / gib:8.1f}Gi "
            f"{xla['temporaries'] / gib:7.1f}Gi {total / gib:8.1f}Gi  "
            f"{', '.join(row['fits']) or 'none'}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "memory.json")
  with open(path, "w") as f:
    json.dump({"fit_fraction": FIT_FRACTION, "chips": CHIPS, "results": results}, f, indent=1,
              default=str)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
