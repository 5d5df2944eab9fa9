"""What only a GPU shows, in one short run (not tests; bench/gpu_checks.sh runs it there):

  python bench/gpu_checks.py [--parts peak,attention,attention_speed,train_step,train_step_1p5b,
                                      engine,quickstart,pretrained,hybrid,moe]
                             [--out bench/results] [--small]

peak             the bf16 matrix product's TFLOP/s on this GPU (8192^3, median of 5 warm
                 calls): the reference of the MFU figures below.
attention        the GPU kernels through models/attention/dispatch.py against the float32
                 dense reference, forward and gradients, packed rows with padding and grouped
                 KV heads, in bf16 and float32, for pallas_gpu, cudnn, blockwise and auto: the
                 largest error over real tokens, the kernel `plan` picked, or the error raised;
                 and ring_pallas_gpu, ring attention on a one-device context axis over our
                 Pallas chunk kernel (models/attention/pallas_gpu.py, what each ring step runs
                 on a GPU), lowered through Triton.
attention_speed  forward+backward, bf16, one row of 8 packed documents at 4k, 16k and 32k
                 tokens, 16 heads over 4 KV heads of 128: pallas_gpu vs ring_pallas_gpu vs
                 cudnn vs blockwise (and the two Pallas ones alone at 128k), the compiled
                 executable's peak memory and the median of 5 warm calls.
train_step       one k1.5 train step (forward, chunked log-probs, backward, AdamW) of a model
                 of width 1024, 8 layers, vocabulary 32,768, computing in bf16, on one packed
                 16,384-token row, attention pallas_gpu vs cudnn vs blockwise: seconds,
                 tokens/s, MFU against `peak`, and the losses.
train_step_1p5b  the same at Qwen2.5-1.5B's shape (width 1536, 28 layers, 12 heads over 2 KV
                 heads, MLP 8960, vocabulary 151,936) on one packed 32,768-token row, layers
                 rematerialised: long context's train step and its MFU.
engine           the embedded engine (rollouts/jax_engine.py) on the GPU: generation tokens/s
                 (256 sequences x 64 tokens, the quickstart's model) and the engine-vs-trainer
                 log-prob gap on its samples, in float32 and bf16.
quickstart       experiments/configs/quickstart.gin for 50 RL steps on the GPU: SFT seconds,
                 the median RL step's seconds and its parts, accuracies, the engine-trainer
                 log-prob gap.
pretrained       RL from a Qwen2.5-1.5B-shaped Hugging Face checkpoint (random weights) in
                 bf16 with f32 master weights on the embedded engine: generation and training
                 tokens/s and MFU against `peak` (rl.pretrained.HFCheckpoint).
hybrid           a 12 GiB train state moved to pinned host memory and back (RLConfig.hybrid):
                 seconds each way, and the device memory the driver sees given back, under
                 JAX's default allocator and under XLA_PYTHON_CLIENT_ALLOCATOR=platform.
moe              bench/moe.py on the GPU (5 rounds): a mixture's train step dropless (grouped
                 matrix products, which XLA:GPU lowers to grouped kernels, XLA:CPU over every
                 group) and at capacity factor 1.25 against the dense step of the same
                 active parameters: seconds, ratios, temporary memory.

Each part's rows are printed and written to OUT/gpu_checks.json as soon as the part ends (a
run cut short keeps what it measured); a part that raises records its error and the next one
runs. --small shrinks every size (a dry run on CPU: its numbers mean nothing).
"""

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

GiB = 2 ** 30
SMALL = False  # --small


def _median_seconds(fn, *args, n: int = 5) -> float:
  jax.block_until_ready(fn(*args))  # warm
  times = []
  for _ in range(n):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _packed_segments(seq: int, docs: int) -> np.ndarray:
  """i32[seq]: `docs` documents of equal length, numbered from 1."""
  return np.repeat(np.arange(1, docs + 1), seq // docs).astype(np.int32)


def part_peak():
  n = 1024 if SMALL else 8192
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.bfloat16)
  seconds = _median_seconds(jax.jit(lambda a, b: a @ b), a, a)
  return [{"n": n, "seconds": seconds, "tflops": 2 * n ** 3 / seconds / 1e12}]


def _attend(kernel):
  """(attention function, the mesh to call it under) for a dispatch kernel or
  "ring_pallas_gpu": ring attention over our Pallas chunk kernel on a one-device `context`
  axis (its rows are in zigzag order already: with one device that is their own)."""
  from models import sharding
  from models.attention import dispatch, ring
  if kernel == "ring_pallas_gpu":
    return (lambda q, k, v, s: ring.attention(q, k, v, s, chunks="pallas_gpu"),
            sharding.make_mesh(context=1))
  return lambda q, k, v, s: dispatch.attention(q, k, v, s, kernel=kernel), None


def part_attention():
  from models import sharding
  from models.attention import dispatch, reference

  batch, seq, heads, kv_heads, dim = 2, (128 if SMALL else 1024), 8, 2, 64
  rng = np.random.default_rng(0)
  q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
  k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
  v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
  cotangent = rng.normal(size=q.shape).astype(np.float32)
  # Row 0: three documents and padding; row 1: one document filling the row.
  a, b = seq * 3 // 10, seq // 2
  seg = np.stack([np.concatenate([np.full(a, 1), np.full(b, 2), np.full(seq - a - b - 24, 3),
                                  np.zeros(24)]), np.ones(seq)]).astype(np.int32)
  real = seg != 0

  def grads(attend, dtype):
    def f(q, k, v, cot):
      out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, jnp.asarray(seg)), q, k, v)
      return (out, *pullback(cot.astype(out.dtype)))
    return jax.jit(f)(*(jnp.asarray(x, dtype) for x in (q, k, v, cotangent)))

  expected = grads(lambda q, k, v, s: reference.attention(q, k, v,
                                                          reference.segment_causal_mask(s)),
                   jnp.float32)
  rows = []
  for dtype in (jnp.bfloat16, jnp.float32):
    for kernel in ("pallas_gpu", "ring_pallas_gpu", "cudnn", "blockwise", "auto"):
      row = {"dtype": jnp.dtype(dtype).name, "kernel": kernel}
      try:
        attend, mesh = _attend(kernel)
        row["runs"] = ("ring/pallas_gpu" if mesh is not None
                       else dispatch.plan(kernel, 1, dtype))
        with sharding.use(mesh):
          got = grads(attend, dtype)
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
          g, e = np.asarray(g, np.float32), np.asarray(e)
          keep = real[:, :, None, None] if name in ("out", "dq") else np.ones_like(g, bool)
          row[f"{name}_max_err"] = float(np.abs(g - e)[np.broadcast_to(keep, g.shape)].max())
      except Exception as e:  # noqa: BLE001 - what a GPU user would meet, recorded
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      rows.append(row)
      print(row, flush=True)
  return rows


def part_attention_speed():
  from models import sharding

  heads, kv_heads, dim = 16, 4, 128
  rows = []
  for seq in ((1024, 2048) if SMALL else (4096, 16384, 32768, 131072)):
    seg = jnp.asarray(_packed_segments(seq, 8)[None])
    arg = lambda h: jnp.asarray(np.random.default_rng(seq).normal(size=(1, seq, h, dim)),
                                jnp.bfloat16)
    q, k, v = arg(heads), arg(kv_heads), arg(kv_heads)
    # Causal within each document: QK^T and PV over half of each document's square, forward;
    # the backward pass about 2.5 times that.
    flops = 3.5 * 2 * 2 * heads * dim * 8 * (seq // 8) ** 2 / 2
    # At 128k cuDNN's [seq, seq] mask alone is 16 GiB and blockwise takes minutes.
    pallas = ("pallas_gpu", "ring_pallas_gpu")
    for kernel in pallas if seq > 32768 else (*pallas, "cudnn", "blockwise"):
      row = {"seq": seq, "kernel": kernel}
      try:
        attend, mesh = _attend(kernel)

        def f(q, k, v, attend=attend):
          out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
          return pullback(out)
        fn = jax.jit(f)
        with sharding.use(mesh):
          row["peak_bytes"] = _peak_bytes(fn.lower(q, k, v).compile())
          row["seconds"] = _median_seconds(fn, q, k, v)
        row["tflops"] = flops / row["seconds"] / 1e12
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      rows.append(row)
      print(row, flush=True)
  return rows


# (width, layers, heads, KV heads, MLP width, vocabulary, tokens in the row, remat)
TRAIN_SHAPES = {"train_step": (1024, 8, 16, 4, 2816, 32768, 16384, "none"),
                "train_step_1p5b": (1536, 28, 12, 2, 8960, 151936, 32768, "full")}


def part_train_step(peak_tflops=None, shape="train_step"):
  from models import config, transformer
  from rl import losses
  from rl.loop import rl_optimizer
  from rl.train_step import init_train_state, make_train_step
  from rl.types import TrainBatch

  width, layers, heads, kv_heads, inter, vocab, seq, remat = TRAIN_SHAPES[shape]
  docs = 8
  if SMALL:
    width, layers, heads, kv_heads, inter, vocab, seq = 128, 2, 4, 2, 256, 512, 1024
  dim = width // heads
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, vocab, (1, seq)).astype(np.int32)
  batch = TrainBatch(tokens=jnp.asarray(tokens), targets=jnp.asarray(np.roll(tokens, -1, 1)),
                     positions=jnp.asarray(np.tile(np.arange(seq // docs), docs)[None]),
                     segment_ids=jnp.asarray(_packed_segments(seq, docs)[None]),
                     loss_mask=jnp.ones((1, seq), jnp.float32),
                     old_logp=jnp.full((1, seq), -9.0, jnp.float32),
                     advantages=jnp.asarray(rng.normal(size=(1, seq)), jnp.float32))
  matmul_params = layers * (width * heads * dim * 2 + 2 * width * kv_heads * dim
                            + 3 * width * inter) + width * vocab
  flops = (6 * matmul_params * seq
           + 3 * layers * 2 * 2 * heads * dim * docs * (seq // docs) ** 2 / 2)
  rows = []
  for kernel in ("pallas_gpu", "cudnn", "blockwise"):
    row = {"kernel": kernel, "seq": seq, "width": width, "layers": layers, "vocab": vocab,
           "dtype": "bfloat16", "param_dtype": "float32", "remat": remat}
    try:
      cfg = dataclasses.replace(
          config.tiny(vocab, hidden_size=width, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, intermediate_size=inter, attention=kernel,
                      remat=remat),
          dtype="bfloat16")
      optimizer = rl_optimizer(1e-5)
      step = jax.jit(make_train_step(cfg, optimizer, losses.bind("k1.5", None)))
      state = init_train_state(transformer.init_params(cfg, jax.random.PRNGKey(0)), optimizer)
      compiled = step.lower(state, batch).compile()
      row["peak_bytes"] = _peak_bytes(compiled)
      _, metrics = compiled(state, batch)
      row["loss"] = float(metrics["loss"])
      times = []
      for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - start)
      row["seconds"] = statistics.median(times)
      row["tokens_per_s"] = seq / row["seconds"]
      row["tflops"] = flops / row["seconds"] / 1e12
      if peak_tflops:
        row["mfu_vs_peak"] = row["tflops"] / peak_tflops
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(row, flush=True)
  return rows


def part_engine():
  from models import config, transformer
  from models.tokenizer import CharTokenizer
  from rl.packing import trajectory_batch
  from rl.train_step import policy_logprobs
  from rollouts.engine import SamplingParams
  from rollouts.jax_engine import JaxEngine

  vocab = CharTokenizer().vocab_size
  n, new = (32, 16) if SMALL else (256, 64)
  rng = np.random.default_rng(0)
  prompts = [[1, *rng.integers(3, vocab, rng.integers(4, 24)).tolist()] for _ in range(n)]
  rows = []
  for dtype in ("float32", "bfloat16"):
    row = {"dtype": dtype, "sequences": n, "new_tokens": new}
    try:
      cfg = dataclasses.replace(config.tiny(vocab), dtype=dtype)  # the quickstart's model
      params = transformer.init_params(cfg, jax.random.PRNGKey(0))
      engine = JaxEngine(cfg, params)
      sampling = SamplingParams(max_new_tokens=new, temperature=1.0)
      engine.generate(prompts, sampling, seed=0)  # compiles
      start = time.perf_counter()
      out = engine.generate(prompts, sampling, seed=1)
      seconds = time.perf_counter() - start
      made = sum(len(c.token_ids) for c in out)
      row.update(seconds=seconds, tokens_per_s=made / seconds)
      batch, _ = trajectory_batch(prompts, [c.token_ids for c in out],
                                  [c.logprobs for c in out], [0.0] * n, [True] * n,
                                  seq_len=128)
      logp, _ = jax.jit(policy_logprobs, static_argnums=1)(params, cfg,
                                                           jax.tree.map(jnp.asarray, batch))
      diff = np.abs(np.asarray(logp) - batch.old_logp)[batch.loss_mask > 0]
      row.update(logp_diff_mean=float(diff.mean()), logp_diff_max=float(diff.max()))
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-600:]}"
    rows.append(row)
    print(row, flush=True)
  return rows


def part_quickstart():
  steps = 4 if SMALL else 50
  run_dir = tempfile.mkdtemp(prefix="longrl-gpu-quickstart-")
  argv = [sys.executable, os.path.join(ROOT, "experiments/run.py"),
          "--gin", os.path.join(ROOT, "experiments/configs/quickstart.gin"),
          "--gin_param", f"RLConfig.num_steps = {steps}", "--gin_param", "Evaluation.every = 25",
          "--gin_param", "Hooks.checkpoint_every = 50", "--gin_param", "Hooks.progress = False",
          "--run_dir", run_dir]
  if SMALL:
    argv += ["--gin_param", "WarmStart.steps = 20", "--gin_param", "Evaluation.every = 2",
             "--gin_param", "Evaluation.records = 16"]
  start = time.perf_counter()
  done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
  row = {"rl_steps": steps, "wall_seconds": time.perf_counter() - start,
         "returncode": done.returncode}
  if done.returncode:
    row["error"] = done.stderr[-1500:]
    return [row]
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  steps_ = [r for r in records if "train_s" in r][1:]  # the first compiles
  parts = ("generate_s", "verify_s", "score_s", "pack_s", "train_s", "weight_sync_s")
  row.update({k: summary.get(k) for k in ("sft_seconds", "sft_accuracy", "rl_accuracy")})
  row["step_seconds_median"] = statistics.median(sum(r[p] for p in parts) for r in steps_)
  row.update({f"{p}_median": statistics.median(r[p] for r in steps_) for p in parts})
  row["engine_logp_diff_max"] = max(r.get("engine_logp_diff_max", 0.0) for r in steps_)
  row["last_line"] = done.stdout.strip().splitlines()[-1]
  print(row, flush=True)
  return [row]


def part_pretrained(peak_tflops=None):
  """RL steps of a Qwen2.5-1.5B-shaped checkpoint (random weights, written as a Hugging Face
  directory with a small trained tokenizer) through train.model = HFCheckpoint: bf16
  compute, float32 master weights, remat, GRPO with its KL to the checkpoint, the embedded
  engine on the same GPU. Random weights never stop early, so every completion runs to
  max_new_tokens: generation and training tokens/s and MFU against `peak` (6 x params per
  trained token, plus 2 x params for the reference's forward; 2 x params per generated
  token)."""
  from experiments import tiny_checkpoint
  from models import hf, transformer
  from rl import trainer
  from rl.config import RLConfig
  from rl.pretrained import HFCheckpoint
  from rl.tasks.math import MathTask
  from rollouts.jax_engine import embedded_engine
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  from memory import CONFIGS
  work = tempfile.mkdtemp(prefix="longrl-gpu-pretrained-")
  shape = dict(CONFIGS["qwen2.5-1.5b"])
  if SMALL:
    shape.update(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
  data = tiny_checkpoint.write_data(work, num_train=512, num_test=64)
  tiny_checkpoint.write_tokenizer(work, tiny_checkpoint.corpus(data), family="qwen2")
  cfg = hf.config_from_hf(shape, param_dtype="bfloat16")
  hf.save(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg, work)
  steps, new_tokens = (3, 32) if SMALL else (4, 1024)
  rl = RLConfig(num_steps=steps, learning_rate=1e-6, prompts_per_step=32 if not SMALL else 4,
                samples_per_prompt=8, max_new_tokens=new_tokens, seq_len=new_tokens + 256,
                micro_batches=1 if SMALL else 8)
  run_dir = os.path.join(work, "run")
  started = time.perf_counter()
  # The engine as recipes/grpo_math.gin has it: bf16 copies of the weights, and a KV budget
  # that splits the step's 256 rows of 256 + 1024 tokens (28 KiB a token) in four batches.
  engine = functools.partial(embedded_engine, dtype="bfloat16",
                             kv_cache_gib=0.5 if SMALL else 4)
  summary = trainer.train(
      run_dir, task=MathTask(train_path=f"{data}/train.jsonl", test_path=f"{data}/test.jsonl",
                             fields={"problem": "question"}),
      model=HFCheckpoint(work, dtype="bfloat16", param_dtype="float32", remat="full"),
      engine=engine, rl=rl, objective=trainer.Objective(loss="grpo"),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=8), progress=False,
                          tensorboard=False, checkpoint_every=100))
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  warm = [r for r in records if "train_s" in r][1:]  # the first step compiles
  params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))))
  generated = statistics.median(r["completion_length"] * rl.prompts_per_step *
                                rl.samples_per_prompt for r in warm)
  task = MathTask(train_path=f"{data}/train.jsonl", test_path=f"{data}/test.jsonl",
                  fields={"problem": "question"})
  prompt = len(HFCheckpoint(work).tokenizer().encode(task.prompt(task.train[0]), add_bos=True))
  trained = generated + prompt * rl.prompts_per_step * rl.samples_per_prompt
  generate_s = statistics.median(r["generate_s"] for r in warm)
  train_s = statistics.median(r["train_s"] for r in warm)
  row = {"params": params, "steps": steps, "wall_seconds": time.perf_counter() - started,
         "generated_tokens_per_step": generated, "generate_s": generate_s, "train_s": train_s,
         "generate_tokens_per_s": generated / generate_s, "train_tokens_per_s": trained / train_s,
         "weight_sync_s": statistics.median(r["weight_sync_s"] for r in warm),
         "summary": {k: summary.get(k) for k in ("sft_accuracy", "rl_accuracy", "steps")},
         "peak_bytes_in_use": (jax.local_devices()[0].memory_stats() or {}).get(
             "peak_bytes_in_use")}
  row["engine_weights"] = _engine_weights(work, cfg, task, rl)
  if peak_tflops:
    row["train_mfu"] = 8 * params * trained / train_s / (peak_tflops * 1e12)
    row["generate_mfu"] = 2 * params * generated / generate_s / (peak_tflops * 1e12)
  print(row, flush=True)
  return [row]


def _engine_weights(work: str, cfg, task, rl) -> list[dict]:
  """Generation tokens/s of the embedded engine over the float32 master weights as they are
  and over bf16 copies (embedded_engine.dtype), the same prompts and seed."""
  from rl.pretrained import HFCheckpoint
  from rollouts.engine import SamplingParams
  from rollouts.jax_engine import JaxEngine
  model = HFCheckpoint(work, dtype="bfloat16", param_dtype="float32")
  params = model.load(model(0))
  tokenizer = model.tokenizer()
  prompts = [tokenizer.encode(task.prompt(task.train[i]), add_bos=True) for i in range(64)]
  sampling = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=1.0)
  rows = []
  for dtype in (None, "bfloat16"):
    engine = JaxEngine(model(0), params, dtype=dtype)
    engine.generate(prompts, sampling, seed=0)  # compiles
    start = time.perf_counter()
    made = sum(len(c.token_ids) for c in engine.generate(prompts, sampling, seed=1))
    rows.append({"weights": dtype or "float32", "sequences": len(prompts),
                 "tokens_per_s": made / (time.perf_counter() - start)})
  return rows


# A hybrid deployment's trainer side, in a process of its own (the allocator is chosen before
# JAX starts): a train state (params and AdamW's moments, float32) of GIB GiB moved to pinned
# host memory and back (rl.loop with RLConfig.hybrid), the device memory in use as the driver
# sees it (nvidia-smi) at each point: what an SGLang server beside it could have.
_HYBRID = """
import json, subprocess, sys, time
import jax, jax.numpy as jnp, optax
from models import sharding
used = lambda: int(subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used",
                                             "--format=csv,noheader,nounits"]).split()[0])
gib = float(sys.argv[1])
params = {f"w{i}": jnp.ones((1024, 1024 * 16), jnp.float32)  # 64 MiB each: a third of it
          for i in range(max(1, int(gib * 16 / 3)))}
state = (params, optax.adamw(1e-6).init(params))
state = jax.block_until_ready(state)
row = {"allocator": sys.argv[2], "used_mib_before": used(),
       "state_gib": sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30}
t = time.perf_counter(); state = sharding.in_memory(state, "pinned_host")
row.update(offload_s=time.perf_counter() - t, used_mib_offloaded=used())
t = time.perf_counter(); state = sharding.in_memory(state, "device")
row.update(reload_s=time.perf_counter() - t, used_mib_reloaded=used())
row["given_back_gib"] = (row["used_mib_before"] - row["used_mib_offloaded"]) / 1024
print(json.dumps(row))
"""


def part_hybrid():
  """The train state to pinned host memory and back, under JAX's default (BFC) allocator and
  under XLA_PYTHON_CLIENT_ALLOCATOR=platform (the one that frees device memory for other
  processes): seconds each way and the GiB the driver sees given back."""
  rows = []
  for allocator in ("bfc", "platform"):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if allocator == "platform":
      env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    done = subprocess.run([sys.executable, "-c", _HYBRID, "0.1" if SMALL else "12",
                           allocator], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    row = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
           {"allocator": allocator, "error": done.stderr[-1500:]})
    rows.append(row)
    print(row, flush=True)
  return rows


def part_moe():
  """bench/moe.py's comparison, run as it runs on a CPU, here on the GPU."""
  with tempfile.TemporaryDirectory() as out:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "moe.py"), "--rounds",
                           "2" if SMALL else "5", "--out", out], cwd=ROOT, capture_output=True,
                          text=True, timeout=420)
    if done.returncode:
      return [{"error": done.stderr[-1500:]}]
    print(done.stdout, flush=True)
    with open(os.path.join(out, "moe.json")) as f:
      return [json.load(f)]


PARTS = ("peak", "attention", "attention_speed", "train_step", "train_step_1p5b", "engine",
         "quickstart", "pretrained", "hybrid", "moe")


def main():
  global SMALL
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default=",".join(PARTS))
  parser.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  SMALL = args.small
  results = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
             "jax": jax.__version__, "small": SMALL}
  print(results, flush=True)
  os.makedirs(args.out, exist_ok=True)
  for part in args.parts.split(","):
    started = time.perf_counter()
    try:
      peak = results.get("peak", [{}])[0].get("tflops")
      if part in TRAIN_SHAPES:
        results[part] = part_train_step(peak, part)
      elif part == "pretrained":
        results[part] = part_pretrained(peak)
      else:
        results[part] = globals()[f"part_{part}"]()
    except Exception as e:  # noqa: BLE001 - the other parts still run
      results[part] = [{"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}]
      print(results[part], flush=True)
    print(f"[{part}] {time.perf_counter() - started:.0f} s", flush=True)
    with open(os.path.join(args.out, "gpu_checks.json"), "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
