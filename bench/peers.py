"""Our GRPO train step and greedy generation against peers, on one peer config. Not a test.

  python bench/peers.py [--peers torch,trl,trl_no_ckpt,tunix] [--rounds N] [--out DIR]

Config (issue 3): Qwen2-style, vocab 8192, width 512, 8 layers, 8 heads over 2 KV heads,
intermediate 1408, fp32; the train step on 8 rows x 512 tokens (128 prompt + 384 completion,
loss on the completion only): forward, per-token log-probs, clipped GRPO loss, backward, AdamW.
Generation: 8 prompts x 128 tokens, 256 new tokens, greedy, KV cache.

Ours in two forms: `ours` keeps every layer's activations for the backward pass, `ours_ckpt`
rematerialises each layer (ModelConfig.remat="full"); both donate the train state to the step
(`make_train_step(donate_state=True)`: an update in place, as PyTorch's optimizers do). Each
peer is timed against its like: TRL's default checkpoints its layers and meets ours_ckpt;
torch, trl_no_ckpt and tunix keep their activations and meet ours.

Peers, each installed by this script into its own virtual environment under bench/.venvs/
(so that their pins never meet ours):
  torch        a plain PyTorch loop on transformers' Qwen2ForCausalLM (sdpa attention), and
               transformers' generate
  trl          TRL's GRPOTrainer loss path (compute_loss + backward + its AdamW step) on the
               same model, with TRL's default gradient checkpointing
  trl_no_ckpt  the same without gradient checkpointing
  tunix        Tunix's Qwen2 model: its GRPO loss under nnx.jit with an optax AdamW step, and
               its Sampler

Every part is served by its own process (its peak RSS is its own), built and warmed up once.
This machine's speed drifts by 20-50% over minutes, so parts timed one after another give
ratios of moments, not of code: ours and each peer are timed in turns instead, one step (and
one generation) each, `--rounds` times, the order alternating, and a speedup is the median
over the turns of peer time / our time. The table also gives each side's fastest time. Peak
RSS is the train step's: noted after two steps, before any generation. MFU = model FLOPs per
second (fastest step) / the fp32 peak: the fastest 2048^3 matmul of the run, numpy's (which
every part times in its turns: its ratio, peer / ours, shows how even the turns were; ~1) or
a framework's own (jax.jit for ours and Tunix, torch.mm for PyTorch and TRL; on an AMD EPYC
numpy's OpenBLAS reached half of XLA's rate, which put MFU above 100%), with
model FLOPs = 6 x tokens x (matmul parameters) + 6 x layers x rows x seq^2 x heads x head_dim
/ 2 (causal attention), the same formula for everyone.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = os.path.join(ROOT, "bench", ".venvs")
PEER = dict(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64,
            intermediate=1408, rows=8, prompt=128, completion=384, new_tokens=256,
            gen_prompts=8, gen_prompt_len=128)
SEQ = PEER["prompt"] + PEER["completion"]
REQUIREMENTS = {
    "torch": ["torch==2.13.0", "transformers", "numpy"],
    "trl": ["torch==2.13.0", "transformers", "trl", "datasets", "numpy"],
    "tunix": ["google-tunix", "numpy"],
}


def model_flops() -> float:
  p = PEER
  per_layer = p["hidden"] * (p["heads"] + 2 * p["kv_heads"]) * p["head_dim"] + \
      p["heads"] * p["head_dim"] * p["hidden"] + 3 * p["hidden"] * p["intermediate"]
  matmul_params = p["layers"] * per_layer + p["hidden"] * p["vocab"]  # + the output head
  tokens = p["rows"] * SEQ
  attention = 6 * p["layers"] * p["rows"] * SEQ ** 2 * p["heads"] * p["head_dim"] / 2
  return 6 * tokens * matmul_params + attention


# What a part can time: "matmul" is numpy's (the same on every side), "own_matmul" its
# framework's; the fastest of either measures the machine's fp32 peak.
MEASURES = ("step", "gen", "matmul", "own_matmul")
SETTLE_S = 1.0  # pause before each timed run, see `paired`
PEAK_N = 2048  # the matmul that measures this machine's fp32 peak: [n, n] @ [n, n]


def own_matmul(framework: str):
  """A zero-argument function running the peak-measuring matmul through the part's own
  framework ("jax" or "torch"), waiting for its result."""
  import numpy as np
  a = np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)
  if framework == "torch":
    import torch
    t = torch.from_numpy(a)
    return lambda: torch.mm(t, t)
  import jax
  x = jax.numpy.asarray(a)
  square = jax.jit(lambda x: x @ x)
  return lambda: jax.block_until_ready(square(x))


def peak_matmul():
  """A zero-argument function running the peak-measuring matmul through numpy's BLAS (every
  venv has numpy); its GFLOP/s is 2 n^3 / its seconds."""
  import numpy as np
  a = np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)
  return lambda: a @ a


def _timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _peak_rss():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batch_numpy():
  import numpy as np
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, PEER["vocab"], (PEER["rows"], SEQ)).astype(np.int32)
  advantages = rng.standard_normal(PEER["rows"]).astype(np.float32)
  return tokens, advantages


# ---- ours ----

def ours_setup(remat: str = "none"):
  """(cfg, optimizer, initial TrainState, TrainBatch) of the peer config, in our terms (the
  caller has the repository on sys.path); `remat` is ModelConfig.remat."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from models import config, transformer
  from rl.train_step import init_train_state
  from rl.types import TrainBatch

  p = PEER
  cfg = config.ModelConfig(vocab_size=p["vocab"], hidden_size=p["hidden"],
                           num_layers=p["layers"], num_heads=p["heads"],
                           num_kv_heads=p["kv_heads"], head_dim=p["head_dim"],
                           intermediate_size=p["intermediate"], tie_embeddings=False,
                           remat=remat)
  optimizer = optax.adamw(1e-6)
  # No name keeps the initial parameters once the state has them: PyTorch updates its
  # parameters in place, so a stale copy here would count against our peak RSS only.
  state = init_train_state(transformer.init_params(cfg, jax.random.PRNGKey(0)), optimizer)
  tokens, adv = _batch_numpy()
  mask = np.zeros((p["rows"], SEQ), np.float32)
  mask[:, p["prompt"] - 1:SEQ - 1] = 1.0  # predicting the completion tokens
  batch = TrainBatch(
      tokens=jnp.asarray(tokens), targets=jnp.asarray(np.roll(tokens, -1, axis=1)),
      positions=jnp.broadcast_to(jnp.arange(SEQ), (p["rows"], SEQ)),
      segment_ids=jnp.ones((p["rows"], SEQ), jnp.int32), loss_mask=jnp.asarray(mask),
      old_logp=jnp.full((p["rows"], SEQ), -9.0),
      advantages=jnp.asarray(np.repeat(adv[:, None], SEQ, 1)))
  return cfg, optimizer, state, batch


def build_ours(remat: str = "none") -> dict:
  sys.path.insert(0, ROOT)
  from models import host_allocator
  host_allocator.keep_freed_memory()  # as experiments/run.py does, before JAX starts
  import jax
  from rl import losses
  from rl.train_step import make_train_step
  from rollouts.engine import SamplingParams
  from rollouts.jax_engine import JaxEngine

  p = PEER
  cfg, optimizer, state, batch = ours_setup(remat)
  # donate_state: the step updates the state in place, as PyTorch's optimizers do.
  step = make_train_step(cfg, optimizer, losses.bind("grpo", {"kl_coef": 0.0}),
                         logprob_chunk=1024, donate_state=True)

  def one_step():
    nonlocal state
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)

  tokens = _batch_numpy()[0]
  prompts = [list(row[:p["gen_prompt_len"]]) for row in tokens[:p["gen_prompts"]]]
  sampling = SamplingParams(max_new_tokens=p["new_tokens"], temperature=0.0)
  # The engine reads the parameters of the moment; a new one per call follows the steps.
  generate = lambda: JaxEngine(cfg, state.params).generate(prompts, sampling, seed=0)
  return {"step": one_step, "gen": generate}


# ---- plain PyTorch and transformers' generate ----

def hf_model(p: dict = PEER):
  """transformers' Qwen2 of config `p` (PEER's keys), random weights, fp32."""
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
      num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
      num_key_value_heads=p["kv_heads"], tie_word_embeddings=False, bos_token_id=None,
      eos_token_id=None, pad_token_id=None)
  return transformers.Qwen2ForCausalLM(cfg).float()


def _grpo_loss_torch(logits, targets, advantages, old_logp, eps=0.2):
  import torch
  logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
  ratio = torch.exp(logp - old_logp)
  adv = advantages[:, None]
  per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
  return per_token.mean()


def build_torch() -> dict:
  import torch
  p = PEER
  model = hf_model()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
  tokens, adv = (torch.tensor(x) for x in _batch_numpy())
  tokens = tokens.long()
  targets = tokens[:, p["prompt"]:]
  old_logp = torch.full(targets.shape, -9.0)

  def one_step():
    model.train()
    logits = model(tokens).logits[:, p["prompt"] - 1:-1]
    loss = _grpo_loss_torch(logits, targets, adv, old_logp)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

  prompts = tokens[:p["gen_prompts"], :p["gen_prompt_len"]]

  def generate():
    model.eval()
    with torch.no_grad():
      model.generate(prompts, max_new_tokens=p["new_tokens"], min_new_tokens=p["new_tokens"],
                     do_sample=False)

  return {"step": one_step, "gen": generate}


# ---- TRL ----

def hf_word_tokenizer(vocab_size: int):
  """A transformers tokenizer whose token i is the word "t{i}" (pad 0, eos 1, unk 2)."""
  import tokenizers
  import transformers
  vocab = {f"t{i}": i for i in range(vocab_size)}
  word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t2"))
  word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0",
                                              eos_token="t1", unk_token="t2")


def build_trl(checkpointing: bool = True) -> dict:
  """TRL's default (gradient checkpointing on) or, with checkpointing=False, without it."""
  import tempfile

  import datasets
  import torch
  import trl

  p = PEER
  tokenizer = hf_word_tokenizer(p["vocab"])
  tokens, adv = (torch.tensor(x) for x in _batch_numpy())
  tokens = tokens.long()
  inputs = {"prompt_ids": tokens[:, :p["prompt"]],
            "prompt_mask": torch.ones(p["rows"], p["prompt"], dtype=torch.long),
            "completion_ids": tokens[:, p["prompt"]:],
            "completion_mask": torch.ones(p["rows"], p["completion"], dtype=torch.long),
            "advantages": adv,
            "num_items_in_batch": torch.tensor(float(p["rows"] * p["completion"]))}
  num_items = torch.tensor(p["rows"] * p["completion"])
  model = hf_model()
  args = trl.GRPOConfig(
      output_dir=tempfile.mkdtemp(), per_device_train_batch_size=p["rows"],
      num_generations=p["rows"], max_completion_length=p["completion"], learning_rate=1e-6,
      beta=0.0, use_cpu=True, report_to="none", bf16=False,
      gradient_checkpointing=checkpointing)
  trainer = trl.GRPOTrainer(
      model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
      args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["t5 t6"] * p["rows"]}),
      processing_class=tokenizer)
  if checkpointing:  # Trainer.train() would switch it on
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
  trainer.create_optimizer()

  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() per step

  def one():  # Trainer.training_step without GRPOTrainer's generation in _prepare_inputs
    loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=num_items)
    trainer.accelerator.backward(loss)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)

  return {"step": one}


# ---- Tunix ----

class _WordTokenizer:
  """Token i is the word "t{i}": enough for Tunix's Sampler, which takes strings."""

  def encode(self, text, **kwargs):
    return [int(w[1:]) for w in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(f"t{int(i)}" for i in ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return 1

  def pad_id(self):
    return 0


def build_tunix() -> dict:
  """Tunix's Qwen2 and its GRPO loss (tunix.rl.algo_core.grpo_loss_fn), differentiated and
  applied with optax AdamW under nnx.jit as its PeftTrainer does; generation by its Sampler."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from tunix.generate import sampler as sampler_lib
  from tunix.models.qwen2 import model as qwen2
  from tunix.rl import algo_core, common
  from tunix.rl.grpo import grpo_learner

  p = PEER
  cfg = qwen2.ModelConfig(num_layers=p["layers"], vocab_size=p["vocab"], embed_dim=p["hidden"],
                          hidden_dim=p["intermediate"], num_heads=p["heads"],
                          head_dim=p["head_dim"], num_kv_heads=p["kv_heads"], rope_theta=10000,
                          norm_eps=1e-6, use_tied_embedding=False)
  model = qwen2.Qwen2(cfg, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-6), wrt=nnx.Param)
  algo = grpo_learner.GRPOConfig(beta=0.0)
  algo.temperature = 1.0  # GRPOLearner copies it from the rollout config
  tokens, adv = _batch_numpy()
  example = common.TrainExample(
      prompt_ids=jnp.asarray(tokens[:, :p["prompt"]]),
      prompt_mask=jnp.ones((p["rows"], p["prompt"]), jnp.int32),
      completion_ids=jnp.asarray(tokens[:, p["prompt"]:]),
      completion_mask=jnp.ones((p["rows"], p["completion"]), jnp.int32),
      advantages=jnp.asarray(adv), ref_per_token_logps=None, old_per_token_logps=None)

  @nnx.jit
  def train_step(model, optimizer, example):
    loss_fn = lambda m: algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=1)
    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  cache = sampler_lib.CacheConfig(cache_size=p["gen_prompt_len"] + p["new_tokens"],
                                  num_layers=p["layers"], num_kv_heads=p["kv_heads"],
                                  head_dim=p["head_dim"])
  sampler = sampler_lib.Sampler(model, _WordTokenizer(), cache)
  prompts = [" ".join(f"t{t}" for t in row[:p["gen_prompt_len"]])
             for row in tokens[:p["gen_prompts"]]]
  gen = lambda: sampler(prompts, max_generation_steps=p["new_tokens"],
                        max_prompt_length=p["gen_prompt_len"], eos_tokens=[-1],
                        temperature=0.0)
  return {"step": lambda: jax.block_until_ready(train_step(model, optimizer, example)),
          "gen": gen}


PARTS = {  # name -> (virtual environment, builder)
    "ours": (None, build_ours), "ours_ckpt": (None, lambda: build_ours(remat="full")),
    "torch": ("torch", build_torch), "trl": ("trl", build_trl),
    "trl_no_ckpt": ("trl", lambda: build_trl(checkpointing=False)),
    "tunix": ("tunix", build_tunix)}
# Which of ours each peer is timed against: like for like, TRL's default checkpoints every
# layer's activations and so does ours_ckpt (ModelConfig.remat="full"); the rest keep them.
OURS_FOR = {"torch": "ours", "trl": "ours_ckpt", "trl_no_ckpt": "ours", "tunix": "ours"}


def venv_python(env: str | None) -> str:
  """The python of virtual environment `env` under bench/.venvs (made and installed with
  REQUIREMENTS[env] on first use); ours for None."""
  if env is None:
    return os.path.join(ROOT, ".venv", "bin", "python")
  venv = os.path.join(VENVS, env)
  python = os.path.join(venv, "bin", "python")
  stamp = os.path.join(venv, ".installed")
  if not os.path.exists(stamp):
    print(f"installing {env} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *REQUIREMENTS[env]], check=True)
    open(stamp, "w").close()
  return python


def serve(part: str):
  """Child process: build `part`, run its train step twice (compilation, then a warm step) and
  note the peak RSS, run its other measurements once, then time one run per "step" or "gen"
  line read from stdin (and "matmul", the machine's peak), answering with the seconds; at
  "done", answer with the peak RSS of the train steps and that of the whole process, and exit."""
  runs = PARTS[part][1]()
  runs["matmul"] = peak_matmul()
  runs["own_matmul"] = own_matmul("torch" if PARTS[part][0] in ("torch", "trl") else "jax")
  runs["step"]()
  runs["step"]()
  train_rss = _peak_rss()  # TRL's figure, the memory target, has no generation in it either
  for what, fn in runs.items():
    if what != "step":
      fn()
  print(json.dumps(sorted(runs)), flush=True)
  for line in sys.stdin:
    what = line.strip()
    if what == "done":
      break
    print(json.dumps(_timed(runs[what])), flush=True)
  print(json.dumps({"peak_rss_bytes": train_rss, "peak_rss_with_generation_bytes": _peak_rss()}),
        flush=True)


class Worker:
  """A part served in its own process (so that its peak RSS is its own)."""

  def __init__(self, part: str, command: list[str] | None = None):
    """`command` serves the part (default: this script's `--_serve part` in its venv)."""
    self.part = part
    command = command or [venv_python(PARTS[part][0]), __file__, "--_serve", part]
    self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
    self.measures = self._answer()

  def _answer(self):
    line = self.proc.stdout.readline()
    if not line:
      raise SystemExit(f"bench part {self.part!r} failed (exit {self.proc.wait()})")
    return json.loads(line)

  def time(self, what: str) -> float:
    self.proc.stdin.write(what + "\n")
    self.proc.stdin.flush()
    return self._answer()

  def close(self) -> dict:
    self.proc.stdin.write("done\n")
    self.proc.stdin.flush()
    result = self._answer()
    self.proc.wait()
    return result


def paired(ours: Worker, peer: Worker, what: str, rounds: int) -> dict:
  """Time `what` on ours and the peer in turn, `rounds` times (the order alternating), so that
  both see the machine of the same moment: each side's times, and the peer / ours ratio of each
  turn, whose median is the reported speedup."""
  times = {ours.part: [], peer.part: []}
  for i in range(rounds):
    for worker in ((ours, peer) if i % 2 == 0 else (peer, ours)):
      # Thread pools spin for a while after their last task (OpenMP, OpenBLAS, Eigen): without
      # a pause, whoever ran second in a turn shared the cores with them (the 2048^3 matmul
      # took 0.13 s second, 0.09 s first).
      time.sleep(SETTLE_S)
      times[worker.part].append(worker.time(what))
  ratios = [p / o for p, o in zip(times[peer.part], times[ours.part])]
  return {"seconds": times, "ratios": ratios, "speedup": statistics.median(ratios)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--peers", default=",".join(OURS_FOR),
                      help="each is timed in turns with its counterpart of ours (OURS_FOR)")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--rounds", type=int, default=5,
                      help="turns of ours and each peer, one step (and one generation) each")
  parser.add_argument("--_serve", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._serve:
    serve(args._serve)
    return
  peers = args.peers.split(",")
  for part in peers:
    if part not in OURS_FOR:
      parser.error(f"unknown peer {part!r}; choose from {', '.join(OURS_FOR)}")
  ours = {}
  results = {}
  for part in peers:
    if OURS_FOR[part] not in ours:
      print(f"== {OURS_FOR[part]} (building and compiling)", flush=True)
      ours[OURS_FOR[part]] = Worker(OURS_FOR[part])
    counterpart = ours[OURS_FOR[part]]
    print(f"== {part} in turns with {counterpart.part}, {args.rounds} rounds", flush=True)
    peer = Worker(part)
    results[part] = {what: paired(counterpart, peer, what, args.rounds)
                     for what in MEASURES if what in peer.measures}
    results[part].update(peer.close())
    print(json.dumps(results[part]), flush=True)
  for name, worker in ours.items():
    results[name] = worker.close()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "peers.json"), "w") as f:
    json.dump({"config": PEER, "model_flops_per_step": model_flops(), **results}, f, indent=1)
  report(results)


def report(results: dict):
  """The table: each part's fastest step and generation over its turns (ours and ours_ckpt:
  over all of theirs), MFU against the fastest 2048^3 matmul of the run (numpy's or a
  framework's own), the train step's peak RSS; then per peer the median over the turns of peer
  time / our time, with its range."""
  new_tokens = PEER["gen_prompts"] * PEER["new_tokens"]
  peers = [part for part in results if part in OURS_FOR]
  times = {}  # part -> measure -> every time it took, over all its turns
  for part in peers:
    for what in MEASURES:
      for name, seconds in results[part].get(what, {}).get("seconds", {}).items():
        times.setdefault(name, {}).setdefault(what, []).extend(seconds)
  fastest = {name: {what: min(ts) for what, ts in by_what.items()}
             for name, by_what in times.items()}
  peak = max(2 * PEAK_N ** 3 / best[what] for best in fastest.values()
             for what in ("matmul", "own_matmul") if what in best)
  print(f"fp32 peak (fastest {PEAK_N}^3 matmul of the run): {peak / 1e9:.0f} GFLOP/s")
  print(f"{'':>12} {'s/step':>7} {'MFU':>5} {'peak RSS':>9} {'gen tok/s':>9}")
  for part in [name for name in results if name not in OURS_FOR] + peers:
    r, best = results[part], fastest[part]
    mfu = model_flops() / best["step"] / peak
    gen = f"{new_tokens / best['gen']:9.0f}" if "gen" in best else f"{'-':>9}"
    print(f"{part:>12} {best['step']:7.2f} {mfu:5.0%} {r['peak_rss_bytes'] / 2**30:8.2f}G {gen}")
  for part in peers:
    line = f"{OURS_FOR[part]} vs {part}:"
    for what in ("step", "gen", "matmul"):  # matmul: numpy on both sides, ~1 on even turns
      if what in results[part]:
        ratios = results[part][what]["ratios"]
        line += (f" {what} {results[part][what]['speedup']:.2f}x"
                 f" ({min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} turns)")
    print(line)
  print("speedups: median over turns of the peer's time / ours (> 1: ours faster)")


if __name__ == "__main__":
  main()
