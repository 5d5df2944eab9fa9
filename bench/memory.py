"""Per-device memory of the RL train step at real model sizes, compiled and never run. Not a test.

  python bench/memory.py [--models qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b,qwen3-8b]
      [--tokens 4096,16384,32768] [--param_dtype float32|bfloat16] [--fsdp 8] [--tensor 1]
      [--context 1] [--expert 1] [--capacity_factor 1.25] [--parts train,engine]
      [--out bench/results]

For each model (the numbers of its config.json, below) and tokens per row, the GRPO train
step of an RL run (rl.train_step.make_train_step: a k3 KL to the reference policy, whose
log-probs the step computes; bf16 compute over float32 master weights and AdamW moments, or
with --param_dtype bfloat16 over bf16 ones (HFCheckpoint.param_dtype); every layer
rematerialised; log-probs in chunks of 2048 tokens; the state donated) is lowered
and compiled for a host mesh of fsdp x tensor x context simulated CPU devices with abstract
inputs: no weight is ever materialised. Each data-parallel device trains one row per
micro-batch; with --context > 1 each row is split over that many devices, and attention is
ring attention (long rows: 128k tokens over context=4 or 8). Attention is the blockwise
kernel (linear memory, as the GPU and TPU kernels are; XLA sees all of its buffers). Results
go to OUT/memory.json, or OUT/memory_context.json for a --context > 1 run. XLA's memory analysis of the compiled executable gives one device's
arguments, outputs, aliased (donated) bytes and temporaries: its peak is
arguments + outputs - aliased + temporaries. Beside it, for a dense model, an analytic
estimate (`analytic`).

Mixtures of experts (qwen3-30b-a3b, moonlight-16b-a3b) run with --expert P > 1: the rows
split over fsdp x expert, each device holding E / P experts (expert parallelism, tokens
exchanged all-to-all: models/transformer.py expert_parallel_experts), at capacity factor
--capacity_factor (room for 1.25 times the even share of pairs; 'none' is dropless, whose
grouped matrix products XLA:CPU lowers to a product over every group, so its CPU figure is not
a GPU's). Results go to OUT/memory_moe.json.

A configuration fits a chip when its peak is at most 90% of the chip's memory (the rest for
the runtime, fragmentation and, on one GPU, nothing else: the rollout engine is not counted).

`--parts engine`: the embedded engine's decode of one batch (rollouts.decoding.sample over
bf16 weights, the KV cache in bf16) at the rows a recipe's `embedded_engine.kv_cache_gib`
allows, on one device, beside the weights + KV cache it was sized by.

`--parts lora`: LoRA against full fine-tuning (RLConfig.lora; models/lora.py: every
projection adapted, a mixture's experts at rank // experts), the same GRPO step on one device
(a LoRA run is not sharded yet) at the first of --tokens, for each rank of --lora (0: full
fine-tuning): the train state (the adapters and their moments, beside the frozen base, which
is also the reference: no second copy) and XLA's peak. Results go to OUT/memory_lora.json.

The CPU compiler fuses and schedules differently from XLA:GPU and XLA:TPU, so the figures are
an estimate of the same program's needs, not a measurement on the chip.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from models import hf, lora, sharding, transformer  # noqa: E402
from rollouts import decoding, jax_engine  # noqa: E402
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
    # Mixtures of experts (run with --expert: expert parallelism).
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                      "tie_word_embeddings": False},
    "moonlight-16b-a3b": {"model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 2048,
                          "intermediate_size": 11264, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "num_key_value_heads": 16,
                          "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                          "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
                          "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                          "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
                          "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
                          "norm_topk_prob": True, "scoring_func": "sigmoid",
                          "topk_method": "noaux_tc", "rope_theta": 50000.0,
                          "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
CHIPS = {"80 GB GPU": 80e9, "141 GB GPU": 141e9, "16 GB TPU v5e": 16e9}
FIT_FRACTION = 0.9
GIB = 2**30
LOGPROB_CHUNK = 2048


def model_config(name: str, param_dtype: str = "float32",
                 capacity_factor: float | None = None) -> ModelConfig:
  """The model of CONFIGS[name] in bf16 compute, every layer rematerialised; a mixture's
  experts with `capacity_factor` (None: dropless)."""
  cfg = hf.config_from_hf(CONFIGS[name], dtype="bfloat16", param_dtype=param_dtype,
                          attention="blockwise", remat="full")
  if cfg.moe is None:
    return cfg
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe,
                                                          capacity_factor=capacity_factor))


def param_count(cfg: ModelConfig) -> int:
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  return sum(x.size for x in jax.tree.leaves(shapes))


def analytic(cfg: ModelConfig, tokens: int, mesh_shape: dict[str, int]) -> dict[str, float]:
  """Bytes per device by hand: the sharded state (params, AdamW's two moments), the
  gradients and the reference params, all in the param dtype; the rematerialised layers'
  saved inputs (bf16, one per layer); one layer's recomputation (q, k, v, attention output,
  the MLP's three intermediates, bf16, split over tensor); and one chunk of log-probs'
  float32 logits with their softmax and gradient."""
  shards = mesh_shape["fsdp"] * mesh_shape["tensor"]
  tokens = tokens // mesh_shape.get("context", 1)  # this device's share of the row
  param_bytes = param_count(cfg) * jnp.dtype(cfg.param_dtype).itemsize
  q = cfg.num_heads * cfg.head_dim
  kv = cfg.num_kv_heads * cfg.head_dim
  per_token_layer = 2 * (cfg.hidden_size * 3 + q * 2 + kv * 2 +
                         3 * cfg.intermediate_size) / mesh_shape["tensor"]
  return {
      "state": 3 * param_bytes / shards,
      "gradients": param_bytes / shards,
      "reference": param_bytes / shards,
      "saved_activations": 2 * tokens * cfg.hidden_size * cfg.num_layers,
      "layer_recompute": tokens * per_token_layer,
      "logits": 3 * 4 * LOGPROB_CHUNK * cfg.vocab_size / mesh_shape["tensor"],
  }


def compile_step(cfg: ModelConfig, tokens: int, mesh, lora_rank: int = 0) -> dict[str, int]:
  """XLA's memory analysis of the compiled train step on `mesh` (one device's bytes); with
  `lora_rank`, a LoRA run's (alpha = rank), on one device: its train state the adapters', its
  frozen base (the reference too) an argument never donated; plus "state": the train state's
  bytes."""
  optimizer = loop.rl_optimizer(1e-6)
  loss = losses.bind("grpo", {})
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, sharding.param_shardings(params, mesh))
  trained = params if not lora_rank else jax.eval_shape(lambda p: lora.init_adapters(
      p, lora.LoraConfig(rank=lora_rank, alpha=float(lora_rank)), cfg, jax.random.PRNGKey(1)),
      params)
  state = jax.eval_shape(lambda p: init_train_state(p, optimizer), trained)
  shardings = (sharding.state_shardings(state, optimizer, mesh) if not lora_rank else
               jax.tree.map(lambda _: NamedSharding(mesh, jax.sharding.PartitionSpec()),
                            state))
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       state, shardings)
  rows = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  rows_spec = NamedSharding(mesh, sharding.spec((sharding.BATCH, sharding.SEQ), (rows, tokens),
                                                mesh))

  def field(dtype):
    return jax.ShapeDtypeStruct((rows, tokens), dtype, sharding=rows_spec)

  batch = TrainBatch(tokens=field(jnp.int32), targets=field(jnp.int32),
                     positions=field(jnp.int32), segment_ids=field(jnp.int32),
                     loss_mask=field(jnp.float32), old_logp=field(jnp.float32),
                     advantages=field(jnp.float32))
  step = make_train_step(cfg, optimizer, loss, logprob_chunk=LOGPROB_CHUNK,
                         state_shardings=shardings, donate_state=True)
  with jax.set_mesh(mesh):
    compiled = (step.lower(state, batch, params) if not lora_rank else
                step.lower(state, batch, params, params)).compile()
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return {**_memory(compiled), "state": state_bytes}


# The embedded engine's decode of one batch of a recipe, at the rows its kv_cache_gib allows:
# (model, rows, prompt bucket, max_new_tokens, the recipe).
ENGINE_CASES = (("qwen2.5-1.5b", 256, 256, 3072, "grpo_math.gin: kv_cache_gib = 24"),
                ("qwen3-8b", 16, 2048, 14336, "k15_qwen3.gin: kv_cache_gib = 40"))


def compile_engine(cfg: ModelConfig, rows: int, prompt: int, max_new: int) -> dict[str, int]:
  """XLA's memory analysis of the embedded engine's decode (rollouts.decoding.sample) of
  `rows` prompts on one device, over bf16 weights (embedded_engine.dtype = 'bfloat16')."""
  cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  shape = jax.ShapeDtypeStruct
  compiled = decoding.sample.lower(
      params, shape((rows, prompt), jnp.int32), shape((rows,), jnp.int32),
      jax.random.PRNGKey(0), jnp.float32(1.0), jnp.float32(1.0), cfg=cfg, max_new=max_new,
      stop_ids=(0,)).compile()
  return _memory(compiled)


def _memory(compiled) -> dict[str, int]:
  """One device's bytes in a compiled executable: its peak is arguments + outputs - aliased
  (donated) + temporaries."""
  m = compiled.memory_analysis()
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
          "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
          "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                   + m.temp_size_in_bytes)}


def fits(peak: float) -> list[str]:
  return [chip for chip, capacity in CHIPS.items() if peak <= FIT_FRACTION * capacity]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(CONFIGS))
  parser.add_argument("--tokens", default="4096,16384,32768")
  parser.add_argument("--param_dtype", choices=("float32", "bfloat16"), default="float32",
                      help="master weights' and AdamW moments' dtype")
  parser.add_argument("--fsdp", type=int, default=8)
  parser.add_argument("--tensor", type=int, default=1)
  parser.add_argument("--context", type=int, default=1,
                      help="devices each row is split over (ring attention)")
  parser.add_argument("--expert", type=int, default=1,
                      help="devices a mixture's experts are split over (expert parallelism)")
  parser.add_argument("--capacity_factor", default="1.25",
                      help="a mixture's expert capacity factor, or 'none' for dropless (whose "
                      "grouped products XLA:CPU lowers over every group: not the GPU's memory)")
  parser.add_argument("--parts", default="train,engine",
                      help="train: the train step's table; engine: the embedded engine's; "
                      "lora: LoRA against full fine-tuning on one device")
  parser.add_argument("--lora", default="0,32",
                      help="--parts lora: the ranks compared (0: full fine-tuning)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  # Before JAX starts its backend (importing jax does not): the simulated devices.
  devices = 1 if args.parts == "lora" else args.fsdp * args.tensor * args.context * args.expert
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={devices}")
  parts = args.parts.split(",")
  if parts == ["lora"]:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_lora.json")
    with open(path, "w") as f:
      json.dump({"results": lora_table(args)}, f, indent=1, default=str)
    print(f"wrote {path}")
    return
  if "lora" in parts:
    parser.error("--parts lora runs alone (one device)")
  results = train_table(args) if "train" in parts else []
  engine = engine_table() if "engine" in parts else []
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "memory_context.json" if args.context > 1 else
                      "memory_moe.json" if args.expert > 1 else "memory.json")
  with open(path, "w") as f:
    json.dump({"fit_fraction": FIT_FRACTION, "chips": CHIPS, "results": results,
               "engine": engine}, f, indent=1, default=str)
  print(f"wrote {path}")


def train_table(args) -> list[dict]:
  mesh = sharding.make_mesh(fsdp=args.fsdp, tensor=args.tensor, context=args.context,
                            expert=args.expert)
  mesh_shape = dict(mesh.shape)
  capacity = None if args.capacity_factor == "none" else float(args.capacity_factor)
  print(f"RL train step (GRPO, bf16 compute, {args.param_dtype} master weights + AdamW, remat "
        f"full), mesh fsdp={args.fsdp} x expert={args.expert} x tensor={args.tensor} x "
        f"context={args.context}, one row per data-parallel device, a mixture's experts at "
        f"capacity factor {args.capacity_factor}; bytes per device (analytic: dense only)")
  print(f"{'model':>13} {'params':>7} {'tokens':>7} {'XLA peak':>10} {'temps':>9} "
        f"{'analytic':>10}  fits (peak <= {FIT_FRACTION:.0%} of the chip)")
  results = []
  for name in args.models.split(","):
    cfg = model_config(name, args.param_dtype, capacity)
    count = param_count(cfg)
    for tokens in (int(t) for t in args.tokens.split(",")):
      started = time.perf_counter()
      xla = compile_step(cfg, tokens, mesh)
      estimate = analytic(cfg, tokens, mesh_shape) if cfg.moe is None else {}
      total = sum(estimate.values())
      row = {"model": name, "params": count, "tokens": tokens, "mesh": mesh_shape, **xla,
             "analytic": estimate, "analytic_total": total or None, "fits": fits(xla["peak"]),
             "compile_s": time.perf_counter() - started, "config": dataclasses.asdict(cfg)}
      results.append(row)
      by_hand = f"{total / GIB:8.1f}Gi" if estimate else f"{'-':>10}"
      print(f"{name:>13} {count / 1e9:6.2f}B {tokens:>7} {xla['peak'] / GIB:8.1f}Gi "
            f"{xla['temporaries'] / GIB:7.1f}Gi {by_hand}  "
            f"{', '.join(row['fits']) or 'none'}", flush=True)
  return results


def lora_table(args) -> list[dict]:
  """The train step of each model at each rank of --lora (0: full fine-tuning), one device."""
  mesh = sharding.make_mesh()
  tokens = int(args.tokens.split(",")[0])
  capacity = None if args.capacity_factor == "none" else float(args.capacity_factor)
  print(f"RL train step (GRPO, bf16 compute, {args.param_dtype} master weights or frozen base, "
        f"AdamW, remat full) on one device, one row of {tokens} tokens; LoRA rank 0 is full "
        "fine-tuning")
  print(f"{'model':>13} {'rank':>5} {'trained':>9} {'state':>9} {'XLA peak':>10} "
        f"{'temps':>9}")
  results = []
  for name in args.models.split(","):
    cfg = model_config(name, args.param_dtype, capacity)
    for rank in (int(r) for r in args.lora.split(",")):
      started = time.perf_counter()
      xla = compile_step(cfg, tokens, mesh, rank)
      trained = param_count(cfg) if not rank else lora.count(jax.eval_shape(
          lambda p, r=rank: lora.init_adapters(p, lora.LoraConfig(rank=r), cfg,
                                               jax.random.PRNGKey(1)),
          jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))))
      results.append({"model": name, "rank": rank, "tokens": tokens, "trained": trained,
                      **xla, "compile_s": time.perf_counter() - started})
      print(f"{name:>13} {rank:>5} {trained / 1e6:8.1f}M {xla['state'] / GIB:7.2f}Gi "
            f"{xla['peak'] / GIB:8.1f}Gi {xla['temporaries'] / GIB:7.1f}Gi", flush=True)
  return results


def engine_table() -> list[dict]:
  print("Embedded engine, one batch decoded on one device (bf16 weights and KV cache); "
        "analytic: weights + KV cache")
  print(f"{'model':>13} {'rows':>5} {'prompt':>7} {'new':>6} {'XLA peak':>10} {'KV cache':>9} "
        f"{'analytic':>10}  recipe")
  results = []
  for name, rows, prompt, max_new, recipe in ENGINE_CASES:
    cfg = model_config(name)
    xla = compile_engine(cfg, rows, prompt, max_new)
    cache = rows * (prompt + max_new) * jax_engine.cache_bytes_per_token(cfg)
    weights = 2 * param_count(cfg)
    results.append({"model": name, "rows": rows, "prompt": prompt, "max_new": max_new,
                    **xla, "kv_cache": cache, "weights": weights, "recipe": recipe})
    print(f"{name:>13} {rows:>5} {prompt:>7} {max_new:>6} {xla['peak'] / GIB:8.1f}Gi "
          f"{cache / GIB:7.1f}Gi {(cache + weights) / GIB:8.1f}Gi  {recipe}", flush=True)
  return results


if __name__ == "__main__":
  main()
