"""Our GRPO train step and greedy generation against peers, on one peer config. Not a test.

  python bench/peers.py [--parts ours,torch,trl,tunix] [--rounds N] [--out bench/results]

Config (issue 3): Qwen2-style, vocab 8192, width 512, 8 layers, 8 heads over 2 KV heads,
intermediate 1408, fp32; the train step on 8 rows x 512 tokens (128 prompt + 384 completion,
loss on the completion only): forward, per-token log-probs, clipped GRPO loss, backward, AdamW.
Generation: 8 prompts x 128 tokens, 256 new tokens, greedy, KV cache.

Peers, each installed by this script into its own virtual environment under bench/.venvs/
(so that their pins never meet ours):
  torch   a plain PyTorch loop on transformers' Qwen2ForCausalLM (sdpa attention), and
          transformers' generate
  trl     TRL's GRPOTrainer loss path (compute_loss + backward + its AdamW step) on the same
          model, with TRL's default gradient checkpointing and without it
  tunix   Tunix's Qwen2 model: its GRPO loss under nnx.jit with an optax AdamW step, and its
          Sampler

Every part runs in its own process (its peak RSS is its own) and measures the fp32 matmul
peak of this machine in the same run; MFU = model FLOPs per second / that peak, with model
FLOPs = 6 x tokens x (matmul parameters) + 6 x layers x rows x seq^2 x heads x head_dim / 2
(causal attention), the same formula for everyone. With --rounds N the parts run in turn N
times; each part's row is its fastest step and fastest generation over the rounds and its
highest peak RSS (every round's figures are kept in the JSON): on a shared machine the speed
drifts by 20-50% over minutes, which a single pass of parts run one after another turns into
ratios.
"""

import argparse
import json
import os
import resource
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
STEPS = 3  # timed steps after one warm-up; the minimum is reported
GENS = 3  # timed generations after one warm-up; the fastest is reported


def model_flops() -> float:
  p = PEER
  per_layer = p["hidden"] * (p["heads"] + 2 * p["kv_heads"]) * p["head_dim"] + \
      p["heads"] * p["head_dim"] * p["hidden"] + 3 * p["hidden"] * p["intermediate"]
  matmul_params = p["layers"] * per_layer + p["hidden"] * p["vocab"]  # + the output head
  tokens = p["rows"] * SEQ
  attention = 6 * p["layers"] * p["rows"] * SEQ ** 2 * p["heads"] * p["head_dim"] / 2
  return 6 * tokens * matmul_params + attention


def matmul_peak_numpy() -> float:
  """fp32 GFLOP/s of a large matmul through numpy's BLAS (every venv has numpy)."""
  import numpy as np
  n = 2048
  a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
  a @ a
  best = min(_timed(lambda: a @ a) for _ in range(5))
  return 2 * n ** 3 / best / 1e9


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

def ours_setup():
  """(cfg, optimizer, initial TrainState, TrainBatch) of the peer config, in our terms."""
  sys.path.insert(0, ROOT)
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
                           intermediate_size=p["intermediate"], tie_embeddings=False)
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


def part_ours():
  import jax
  from rl import losses
  from rl.train_step import make_train_step
  from rollouts.engine import SamplingParams
  from rollouts.jax_engine import JaxEngine

  p = PEER
  cfg, optimizer, state, batch = ours_setup()
  step = make_train_step(cfg, optimizer, losses.bind("grpo", {"kl_coef": 0.0}),
                         logprob_chunk=1024)
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)

  def one():
    nonlocal state
    state, m = step(state, batch)
    jax.block_until_ready(m)

  step_s = min(_timed(one) for _ in range(STEPS))
  engine = JaxEngine(cfg, state.params)
  tokens = _batch_numpy()[0]
  prompts = [list(row[:p["gen_prompt_len"]]) for row in tokens[:p["gen_prompts"]]]
  sampling = SamplingParams(max_new_tokens=p["new_tokens"], temperature=0.0)
  engine.generate(prompts, sampling, seed=0)
  gen_s = min(_timed(lambda: engine.generate(prompts, sampling, seed=0)) for _ in range(GENS))
  return {"step_seconds": step_s, "gen_tokens_per_second": p["gen_prompts"] * p["new_tokens"] / gen_s}


# ---- plain PyTorch and transformers' generate ----

def _hf_model():
  import torch
  import transformers
  p = PEER
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


def part_torch():
  import torch
  p = PEER
  model = _hf_model()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
  tokens, adv = (torch.tensor(x) for x in _batch_numpy())
  tokens = tokens.long()
  targets = tokens[:, p["prompt"]:]
  old_logp = torch.full(targets.shape, -9.0)

  def one():
    logits = model(tokens).logits[:, p["prompt"] - 1:-1]
    loss = _grpo_loss_torch(logits, targets, adv, old_logp)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

  one()
  step_s = min(_timed(one) for _ in range(STEPS))
  model.eval()
  prompts = tokens[:p["gen_prompts"], :p["gen_prompt_len"]]
  gen = lambda: model.generate(prompts, max_new_tokens=p["new_tokens"],
                               min_new_tokens=p["new_tokens"], do_sample=False)
  with torch.no_grad():
    gen()
    gen_s = min(_timed(gen) for _ in range(GENS))
  return {"step_seconds": step_s, "gen_tokens_per_second": p["gen_prompts"] * p["new_tokens"] / gen_s}


# ---- TRL ----

def part_trl():
  import tempfile

  import datasets
  import tokenizers
  import torch
  import transformers
  import trl

  p = PEER
  vocab = {f"t{i}": i for i in range(p["vocab"])}
  word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t2"))
  word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0",
                                                   eos_token="t1", unk_token="t2")
  tokens, adv = (torch.tensor(x) for x in _batch_numpy())
  tokens = tokens.long()
  inputs = {"prompt_ids": tokens[:, :p["prompt"]],
            "prompt_mask": torch.ones(p["rows"], p["prompt"], dtype=torch.long),
            "completion_ids": tokens[:, p["prompt"]:],
            "completion_mask": torch.ones(p["rows"], p["completion"], dtype=torch.long),
            "advantages": adv,
            "num_items_in_batch": torch.tensor(float(p["rows"] * p["completion"]))}
  num_items = torch.tensor(p["rows"] * p["completion"])
  result = {}
  for checkpointing in (True, False):  # TRL's default, then without
    model = _hf_model()
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

    one()
    key = "step_seconds" if checkpointing else "step_seconds_no_checkpointing"
    result[key] = min(_timed(one) for _ in range(STEPS))
  return result


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


def part_tunix():
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

  jax.block_until_ready(train_step(model, optimizer, example))
  step_s = min(_timed(lambda: jax.block_until_ready(train_step(model, optimizer, example)))
               for _ in range(STEPS))
  cache = sampler_lib.CacheConfig(cache_size=p["gen_prompt_len"] + p["new_tokens"],
                                  num_layers=p["layers"], num_kv_heads=p["kv_heads"],
                                  head_dim=p["head_dim"])
  sampler = sampler_lib.Sampler(model, _WordTokenizer(), cache)
  prompts = [" ".join(f"t{t}" for t in row[:p["gen_prompt_len"]])
             for row in tokens[:p["gen_prompts"]]]
  gen = lambda: sampler(prompts, max_generation_steps=p["new_tokens"],
                        max_prompt_length=p["gen_prompt_len"], eos_tokens=[-1],
                        temperature=0.0)
  gen()
  gen_s = min(_timed(gen) for _ in range(GENS))
  return {"step_seconds": step_s, "gen_tokens_per_second": p["gen_prompts"] * p["new_tokens"] / gen_s}


PARTS = {"ours": part_ours, "torch": part_torch, "trl": part_trl, "tunix": part_tunix}
ENV_OF = {"ours": None, "torch": "torch", "trl": "trl", "tunix": "tunix"}


def _python_for(part):
  env = ENV_OF[part]
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


def _best_of(runs: list[dict]) -> dict:
  """One part's row from its rounds: the fastest-step round, with the fastest generation of
  any round and the highest peak RSS of any round; every round's figures are kept."""
  best = dict(min(runs, key=lambda r: r["step_seconds"]))
  best["step_seconds_per_round"] = [r["step_seconds"] for r in runs]
  best["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
  if "gen_tokens_per_second" in best:
    gens = [r["gen_tokens_per_second"] for r in runs]
    best["gen_tokens_per_second"], best["gen_tokens_per_second_per_round"] = max(gens), gens
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default="ours,torch")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--rounds", type=int, default=1,
                      help="run the parts in turn this many times and keep each part's fastest "
                      "step and generation: on a shared machine the speed drifts over minutes")
  parser.add_argument("--_part", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._part:  # child process: JSON on the last stdout line
    result = PARTS[args._part]()
    result.update(peak_rss_bytes=_peak_rss(), matmul_gflops=matmul_peak_numpy())
    result["mfu"] = model_flops() / result["step_seconds"] / (result["matmul_gflops"] * 1e9)
    print(json.dumps(result))
    return
  parts = args.parts.split(",")
  for part in parts:
    if part not in PARTS:
      parser.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
  rounds = {part: [] for part in parts}
  for round_ in range(args.rounds):
    for part in parts:
      print(f"== {part} (round {round_ + 1} of {args.rounds})", flush=True)
      proc = subprocess.run([_python_for(part), __file__, "--_part", part],
                            stdout=subprocess.PIPE, text=True)
      if proc.returncode:
        raise SystemExit(f"bench part {part!r} failed (exit {proc.returncode})")
      result = json.loads(proc.stdout.strip().splitlines()[-1])
      print(result, flush=True)
      rounds[part].append(result)
  results = {part: _best_of(runs) for part, runs in rounds.items()}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "peers.json"), "w") as f:
    json.dump({"config": PEER, "model_flops_per_step": model_flops(), **results}, f, indent=1)
  print(f"{'':>14} {'s/step':>7} {'MFU':>5} {'peak RSS':>9} {'gen tok/s':>9}")
  for name, r in results.items():
    gen = f"{r['gen_tokens_per_second']:.0f}" if "gen_tokens_per_second" in r else "-"
    print(f"{name:>14} {r['step_seconds']:7.2f} {r['mfu']:5.0%} "
          f"{r['peak_rss_bytes'] / 2**30:7.2f}G {gen:>9}")
  if "ours" in results:
    for peer, r in results.items():
      if peer != "ours":
        print(f"ours vs {peer}: step {r['step_seconds'] / results['ours']['step_seconds']:.2f}x"
              + (f", generation {results['ours']['gen_tokens_per_second'] / r['gen_tokens_per_second']:.2f}x"
                 if "gen_tokens_per_second" in r else ""))


if __name__ == "__main__":
  main()
