"""Whole RL iterations, ours in lockstep and ahead against TRL's and Tunix's GRPO. Not a test.

  python bench/iteration.py [--parts ours_sync,ours_sync_server,ours_ahead,trl,tunix]
                            [--rounds 3] [--steps 4] [--out bench/results]

One iteration = sample 8 prompts x 8 completions (32-token prompts, up to 256 new tokens,
temperature 1), verify them (reward 1 when a completion holds token 7), group advantages,
one optimizer step of GRPO (clip 0.2, no KL) with AdamW on all 64, and the weight sync to the
engine. The model is the quickstart's (Qwen2-style, width 128, 2 layers, 4 heads over 2 KV
heads, MLP 384, fp32) over the word vocabulary of bench/peers.py (8192 ids, token i = "t{i}").

Parts, each served by its own process (bench/peers.py's Worker):
  ours_sync         rl.loop.rl_steps in lockstep on the embedded engine, both cores
  ours_sync_server  lockstep, the engine a server process (rollouts.server) pinned to core 1
                    and the trainer to core 0: what the pinning costs without overlap
  ours_ahead        the same pinning with Ahead(max_staleness=1): step t + 1's rollouts
                    are generated while step t trains (as on separate devices)
  trl               TRL's GRPOTrainer: one `training_step` with its own generation, both cores
  tunix             Tunix's GRPOLearner: one global step of `train` on an RLCluster with its
                    vanilla rollout (its Sampler) on the trainer's mesh, both cores
  ours_sglang       lockstep on a real SGLang server (bench/gpu_iteration.sh on a GPU, which
                    the trainer shares with the server), the weight sync through the disk
  ours_sglang_ahead the same with Ahead(max_staleness=1)
  ours_sglang_hybrid the same in lockstep with RLConfig.hybrid: the train state in host memory
                    while the server generates, the server's memory released while the
                    trainer trains (it runs --enable-memory-saver)
                    (the three read LONGRL_SGLANG_URL and LONGRL_SGLANG_WEIGHTS, a directory the
                    server reads too; not in the default --parts)
  ours_server_hybrid ours_sync_server with RLConfig.hybrid (not in the default --parts)

Timed like bench/peers.py: the parts take turns, `--rounds` times, each turn `--steps`
iterations in a row of which the first is dropped (it fills the pipeline of ours_ahead,
which starts afresh every turn and is stopped and drained before the next part's turn).
Reported per part: the median seconds per iteration over every kept iteration, iterations/s,
completed tokens/s (tokens generated, pad excluded, per second of iteration), and ours' time
breakdown (generate, verify, pack, train, sync, idle) from the loop's metrics, and the hybrid
parts' switch seconds; then ours_sync against each peer, ours_ahead against ours_sync and each
hybrid part against its lockstep one as the median over the turns of the ratio.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peers  # noqa: E402

ITERATION = dict(vocab=8192, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                 intermediate=384, prompts=8, samples=8, prompt_len=32, new_tokens=256,
                 learning_rate=1e-6, clip_eps=0.2, rewarded_token=7)
BREAKDOWN = ("generate_s", "verify_s", "score_s", "pack_s", "train_s", "weight_sync_s",
             "trainer_idle_s", "engine_idle_s")
SWITCHES = ("switch_to_train_s", "switch_to_inference_s")  # RLConfig.hybrid's


# ---- ours ----

class WordTokenizer:
  """Token i is the word "t{i}" (ids 0, 1, 2: pad, eos, bos), as for the peers."""
  pad_id, eos_id, bos_id, vocab_size = 0, 1, 2, ITERATION["vocab"]

  def encode(self, text, *, add_bos=False, add_eos=False):
    return ([self.bos_id] if add_bos else []) + [int(w[1:]) for w in text.split()] + (
        [self.eos_id] if add_eos else [])

  def decode(self, ids):
    return " ".join(f"t{int(i)}" for i in ids if int(i) > 2)


class RandomPrompts:
  """Prompts of random words; a completion is right when it holds the rewarded token."""

  def __init__(self, num_records: int = 64):
    import numpy as np
    rng = np.random.default_rng(0)
    self.train = [{"prompt": " ".join(f"t{t}" for t in rng.integers(
        3, ITERATION["vocab"], ITERATION["prompt_len"] - 1))} for _ in range(num_records)]
    self.test = self.train

  def prompt(self, record):
    return record["prompt"]

  def solution(self, record):
    return f"t{ITERATION['rewarded_token']}"

  def verify(self, completion, record):
    return f"t{ITERATION['rewarded_token']}" in completion.split()

  def well_formed(self, completion):
    return True


def start_model():
  """(ModelConfig, params) of ours at the start of every part (bench/gpu_iteration.sh gives
  the SGLang server the same weights)."""
  import jax
  from models import config, transformer
  p = ITERATION
  cfg = config.ModelConfig(vocab_size=p["vocab"], hidden_size=p["hidden"],
                           num_layers=p["layers"], num_heads=p["heads"],
                           num_kv_heads=p["kv_heads"], head_dim=p["head_dim"],
                           intermediate_size=p["intermediate"])
  return cfg, transformer.init_params(cfg, jax.random.PRNGKey(0))


def build_ours(engine: str, max_staleness: int = 0, hybrid: bool = False) -> dict:
  """rl.loop.rl_steps on the embedded engine ("embedded"), on our server process pinned to
  core 1 ("server") or on a running SGLang server ("sglang"); "iteration" runs `n` steps from
  a fresh generator (so ahead of the trainer the pipeline starts empty) and drains it before
  returning. `hybrid`: RLConfig.hybrid (the server started with --enable-memory-saver)."""
  from rl import loop, losses, rewards, sampling, sources
  from rl.config import RLConfig
  from rl.train_step import make_train_step
  from rollouts.jax_engine import JaxEngine
  from rollouts.sglang_engine import local_engine, remote_engine

  p = ITERATION
  cfg, params = start_model()
  optimizer = loop.rl_optimizer(p["learning_rate"])
  reward = rewards.named_chain({"correctness": rewards.correctness()})
  rl = RLConfig(prompts_per_step=p["prompts"], samples_per_prompt=p["samples"],
                max_new_tokens=p["new_tokens"], seq_len=p["prompt_len"] + p["new_tokens"],
                learning_rate=p["learning_rate"], hybrid=hybrid)
  task, tokenizer = RandomPrompts(), WordTokenizer()
  if engine == "embedded":
    rollouts = JaxEngine(cfg, params)
  elif engine == "server":
    rollouts = local_engine(cfg, params, 0, cores=[1], memory_saver=hybrid)
  else:
    rollouts = remote_engine(cfg, params, 0, urls=[os.environ["LONGRL_SGLANG_URL"]],
                             weights_dir=os.environ["LONGRL_SGLANG_WEIGHTS"],
                             health_timeout=600, export_dtype="bfloat16")  # --dtype bfloat16
  loss = losses.bind("grpo", {"clip_eps": p["clip_eps"], "kl_coef": 0.0})
  parts = loop.Parts(
      sources.Context(rollouts, task, tokenizer, rl, sampling.uniform()),
      sources.Ahead(max_staleness=max_staleness) if max_staleness else sources.Lockstep(), loss,
      make_train_step(cfg, optimizer, loss, donate_state=True), reward,
      losses.get("grpo").advantage)
  holder = {"state": loop.init_state(params, optimizer, parts, 0)}

  def iterations(n: int) -> list[dict]:
    steps = loop.rl_steps(holder["state"], parts)
    out = []
    try:
      for _ in range(n):
        started = time.perf_counter()
        record = next(steps)
        seconds = time.perf_counter() - started
        holder["state"] = record.state
        out.append({"seconds": seconds,
                    "completion_tokens": int(sum(len(t.token_ids)
                                                 for t in record.trajectories)),
                    **{k: record.metrics[k] for k in BREAKDOWN + SWITCHES
                       if k in record.metrics}})
    finally:
      steps.close()
    # The rollouts of the step after the last, still being made ahead: let them end, so
    # that the next part's turn has the cores to itself.
    for thread in threading.enumerate():
      if thread.name == "rollouts-ahead":
        thread.join(timeout=600)
    return out

  return {"iterations": iterations, "close": rollouts.close}


# ---- the peers ----

def _reward(completions, **kwargs) -> list[float]:
  word = f"t{ITERATION['rewarded_token']}"
  return [float(word in c.split()) for c in completions]


def build_trl() -> dict:
  """TRL's GRPOTrainer: `training_step` generates the 64 completions with the policy itself
  (transformers' generate, no weight sync needed), scores them with the reward function,
  computes group advantages and the loss, and backpropagates; then its AdamW steps (as
  Trainer's inner loop does). No gradient checkpointing, like ours."""
  import tempfile

  import datasets
  import torch
  import trl

  p = ITERATION
  torch.manual_seed(0)
  n = p["prompts"] * p["samples"]
  args = trl.GRPOConfig(
      output_dir=tempfile.mkdtemp(), per_device_train_batch_size=n,
      num_generations=p["samples"], max_completion_length=p["new_tokens"], temperature=1.0,
      learning_rate=p["learning_rate"], epsilon=p["clip_eps"], beta=0.0, use_cpu=True,
      report_to="none", bf16=False, gradient_checkpointing=False)
  trainer = trl.GRPOTrainer(
      model=peers.hf_model(p), reward_funcs=[_reward], args=args,
      train_dataset=datasets.Dataset.from_dict(
          {"prompt": [r["prompt"] for r in RandomPrompts().train]}),
      processing_class=peers.hf_word_tokenizer(p["vocab"]))
  trainer.create_optimizer()
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() per step
  def forever():
    while True:
      yield from trainer.get_train_dataloader()
  batches = forever()

  def iterations(count: int) -> list[dict]:
    out = []
    for _ in range(count):
      batch = next(batches)
      started = time.perf_counter()
      trainer.training_step(trainer.model, batch, num_items_in_batch=None)
      trainer.optimizer.step()
      trainer.optimizer.zero_grad(set_to_none=True)
      seconds = time.perf_counter() - started
      lengths = trainer._metrics["train"]["completions/mean_length"][-1]
      out.append({"seconds": seconds, "completion_tokens": int(round(lengths * n))})
    return out

  return {"iterations": iterations}


class _TunixWordTokenizer:
  """WordTokenizer behind the methods Tunix's TokenizerAdapter calls. `encode` also takes an
  array (Tunix repeats a batch's prompts with numpy): of words, or of token ids already."""

  def encode(self, text, **kwargs):
    import numpy as np
    if isinstance(text, str):
      return [int(w[1:]) for w in text.split()]
    items = np.ravel(text)
    if items.dtype.kind in "USO":
      return [int(w[1:]) for s in items for w in str(s).split()]
    return [int(i) for i in items]

  def decode(self, ids, **kwargs):
    return " ".join(f"t{int(i)}" for i in ids if int(i) != 0)

  def bos_id(self):
    return 2

  def eos_id(self):
    return 1

  def pad_id(self):
    return 0


def build_tunix() -> dict:
  """Tunix's GRPOLearner over an RLCluster with the vanilla rollout (its Sampler), trainer
  and rollout on one mesh: one global step of `GRPOLearner.train` generates the 64
  completions, scores them, computes group advantages, and takes one AdamW step; on one mesh
  the rollout shares the trainer's weights, so Tunix skips its weight sync."""
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from tunix.models.qwen2 import model as qwen2
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  p = ITERATION
  cfg = qwen2.ModelConfig(num_layers=p["layers"], vocab_size=p["vocab"], embed_dim=p["hidden"],
                          hidden_dim=p["intermediate"], num_heads=p["heads"],
                          head_dim=p["head_dim"], num_kv_heads=p["kv_heads"], rope_theta=10000,
                          norm_eps=1e-6, use_tied_embedding=False)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR,
                                            rl_cluster_lib.Role.REFERENCE,
                                            rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine="vanilla", offload_to_cpu=False,
      # No checkpoint directory, metrics options or eval set: nothing written or evaluated.
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adamw(p["learning_rate"]), eval_every_n_steps=10**9,
          max_steps=0),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=p["new_tokens"], max_prompt_length=p["prompt_len"],
          kv_cache_size=p["prompt_len"] + p["new_tokens"], temperature=1.0))
  cluster = rl_cluster_lib.RLCluster(actor=qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)),
                                     tokenizer=_TunixWordTokenizer(), cluster_config=config)
  tokens = [0]

  def reward(prompts, completions, **kwargs):
    tokens[0] += sum(len(c.split()) for c in completions)  # decode leaves pad out
    return _reward(completions)

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[reward], algo_config=grpo_learner.GRPOConfig(
          num_generations=p["samples"], num_iterations=1, beta=0.0, epsilon=p["clip_eps"]))
  prompts = [r["prompt"] for r in RandomPrompts().train]
  def batches():  # arrays, as grain's batches: Tunix repeats each leaf G times with np.repeat
    while True:
      for i in range(0, len(prompts), p["prompts"]):
        yield {"prompts": np.array(prompts[i:i + p["prompts"]])}
  data = batches()

  def iterations(count: int) -> list[dict]:
    out = []
    for _ in range(count):
      # train() runs global steps until the trainer has taken max_steps optimizer steps.
      config.training_config.max_steps = cluster.actor_trainer.train_steps + 1
      tokens[0] = 0
      started = time.perf_counter()
      learner.train(data)
      seconds = time.perf_counter() - started
      out.append({"seconds": seconds, "completion_tokens": tokens[0]})
    return out

  return {"iterations": iterations}


PARTS = {  # name -> (virtual environment, trainer's cores (None: all), builder)
    "ours_sync": (None, "0,1", lambda: build_ours("embedded")),
    "ours_sync_server": (None, "0", lambda: build_ours("server")),
    "ours_ahead": (None, "0", lambda: build_ours("server", max_staleness=1)),
    "trl": ("trl", "0,1", build_trl),
    "tunix": ("tunix", "0,1", build_tunix),
    "ours_sglang": (None, None, lambda: build_ours("sglang")),
    "ours_sglang_ahead": (None, None, lambda: build_ours("sglang", max_staleness=1)),
    "ours_server_hybrid": (None, "0", lambda: build_ours("server", hybrid=True)),
    "ours_sglang_hybrid": (None, None, lambda: build_ours("sglang", hybrid=True)),
}
DEFAULT_PARTS = ("ours_sync", "ours_sync_server", "ours_ahead", "trl", "tunix")
PEERS = ("trl", "tunix")


def serve(part: str):
  """Child process: build `part`, run 2 iterations (compilation, warm-up), then answer each
  "N" read from stdin with the JSON list of N iterations' records; exit at "done"."""
  built = PARTS[part][2]()
  runs = built["iterations"]
  runs(2)
  print(json.dumps("ready"), flush=True)
  for line in sys.stdin:
    if line.strip() == "done":
      break
    print(json.dumps(runs(int(line))), flush=True)
  built.get("close", lambda: None)()
  print(json.dumps({"peak_rss_bytes": peers._peak_rss()}), flush=True)


def worker(part: str) -> peers.Worker:
  env, cores, _ = PARTS[part]
  pin = ["taskset", "-c", cores] if cores else []
  return peers.Worker(part, pin + [peers.venv_python(env), __file__, "--_serve", part])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default=",".join(DEFAULT_PARTS))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=4,
                      help="iterations per turn; the first of each turn is not counted")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--_serve", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._serve:
    serve(args._serve)
    return
  parts = args.parts.split(",")
  for part in parts:
    if part not in PARTS:
      parser.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
  if args.steps < 2:
    parser.error("--steps must be at least 2 (the first of each turn is not counted)")
  workers = {}
  for part in parts:
    print(f"== {part} (building, compiling, 2 warm-up iterations)", flush=True)
    workers[part] = worker(part)
  turns = {part: [] for part in parts}  # part -> per turn, its kept iterations
  for i in range(args.rounds):
    for part in (parts if i % 2 == 0 else parts[::-1]):
      time.sleep(peers.SETTLE_S)
      kept = workers[part].time(str(args.steps))[1:]
      turns[part].append(kept)
      print(f"round {i + 1} {part}: " + " ".join(f"{r['seconds']:.2f}" for r in kept)
            + " s/iteration", flush=True)
  results = {part: {"turns": turns[part], **workers[part].close()} for part in parts}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "iteration.json"), "w") as f:
    json.dump({"config": ITERATION, "rounds": args.rounds, "steps": args.steps, **results},
              f, indent=1)
  report(results)


def _turn_seconds(turn: list[dict]) -> float:
  return statistics.median(r["seconds"] for r in turn)


def report(results: dict):
  print(f"{'':>17} {'s/iter':>7} {'iter/s':>7} {'tok/s':>7} {'peak RSS':>9}  breakdown "
        "(median s: generate verify score pack train sync | idle trainer engine)")
  for part, r in results.items():
    kept = [x for turn in r["turns"] for x in turn]
    seconds = statistics.median(x["seconds"] for x in kept)
    tokens = statistics.median(x["completion_tokens"] / x["seconds"] for x in kept)
    line = (f"{part:>17} {seconds:7.2f} {1 / seconds:7.3f} {tokens:7.0f} "
            f"{r['peak_rss_bytes'] / 2**30:8.2f}G")
    if "train_s" in kept[0]:
      m = {k: statistics.median(x[k] for x in kept) for k in BREAKDOWN}
      line += ("  " + " ".join(f"{m[k]:.2f}" for k in BREAKDOWN[:6])
               + f" | {m['trainer_idle_s']:.2f} {m['engine_idle_s']:.2f}")
    print(line)
  for part, r in results.items():  # each weight sync (export included), as k1.5's infra reports
    syncs = [x["weight_sync_s"] for turn in r["turns"] for x in turn if "weight_sync_s" in x]
    if syncs:
      print(f"{part} weight syncs: {len(syncs)}, median {statistics.median(syncs):.3f} s, "
            f"{min(syncs):.3f}-{max(syncs):.3f} s")
  for part, r in results.items():  # RLConfig.hybrid's turns between trainer and engine
    kept = [x for turn in r["turns"] for x in turn if SWITCHES[0] in x]
    if kept:
      print(f"{part} switches (median s): to train "
            f"{statistics.median(x[SWITCHES[0]] for x in kept):.3f}, to inference "
            f"{statistics.median(x[SWITCHES[1]] for x in kept):.3f}")
  pairs = ([("ours_ahead", "ours_sync"), ("ours_ahead", "ours_sync_server"),
            ("ours_sglang_ahead", "ours_sglang"), ("ours_server_hybrid", "ours_sync_server"),
            ("ours_sglang_hybrid", "ours_sglang")] + [("ours_sync", peer) for peer in PEERS])
  for ours, other in pairs:
    if ours in results and other in results:
      ratios = [_turn_seconds(b) / _turn_seconds(a)
                for a, b in zip(results[ours]["turns"], results[other]["turns"])]
      print(f"{ours} vs {other}: {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} turns; > 1: "
            f"{ours} faster)")


if __name__ == "__main__":
  main()
