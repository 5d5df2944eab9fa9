"""Scale-out on this machine, not a test: a server fleet behind the real sglang-router, and one
train step on one JAX process vs two.

  python bench/scaleout.py [--parts fleet,trainers] [--servers 1,2,4] [--out bench/results]

fleet: for 1, 2 and 4 `python -m rollouts.server` processes (rollouts.sglang_engine.local_engine)
behind sglang-router, one RL iteration's generation at the quickstart's sizes (its model,
random weights; 32 prompts x 8 samples, up to 40 new tokens at temperature 1), through the
router and, on the same servers, straight from the client (its own affinity balancing): the
reference the router is measured against. Completed tokens per second of each, after
WARMUPS untimed warm-up passes per path (the servers compile the batch shapes they meet),
over ROUNDS timed passes (the paths alternating; the median reported). Then the weight
sync, as the loop does it (SGLangEngine.update_weights: export a Hugging Face checkpoint,
then pause, load from disk, continue and check the version on every server in parallel):
the median seconds of SYNCS syncs. On a 2-core machine 4 servers share 2 cores: more
servers do not make more tokens here, what is measured is what the router and the fleet
cost.

trainers: the same k1.5 train step (forward, log-probs, loss, backward, AdamW) of a ~100M
parameter model on the same global batch, its params and moments sharded over fsdp=2: on
one JAX process with 2 CPU devices, and on two processes with one device each (joined with
jax.distributed on 127.0.0.1, each placing only its own rows). Per process: peak RSS (and
its RSS before the state was made: the runtime's share), the median step time of STEPS
steps after one warm-up step, and the losses, which must be equal. On 2 cores the point is
that memory per process halves and the result is equal, not speed.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.agentic import machine  # noqa: E402
from models import config, distributed, sharding, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402

WARMUPS, ROUNDS, SYNCS, STEPS = 3, 5, 3, 3
PROMPTS, SAMPLES, MAX_NEW_TOKENS = 32, 8, 40  # experiments/configs/quickstart.gin's
# The trainers' model: big enough that its state, not the runtime, dominates the memory.
WIDE = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
            intermediate_size=2816)
ROWS, SEQ = 8, 64


def quickstart_model(tokenizer):
  return config.tiny(tokenizer.vocab_size, hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, intermediate_size=384)


def fleet(counts) -> list[dict]:
  from rl.rollout import prompt_ids
  from rl.tasks.arithmetic import Arithmetic
  from rollouts.engine import SamplingParams
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine, local_engine

  tokenizer = CharTokenizer()
  cfg = quickstart_model(tokenizer)
  params = [transformer.init_params(cfg, jax.random.PRNGKey(seed)) for seed in (0, 1)]
  task = Arithmetic(digits=2, operands=3)
  prompts = [prompt_ids(task, tokenizer, task.train[i]) for i in range(PROMPTS)]
  requests = [p for p in prompts for _ in range(SAMPLES)]
  sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                            stop_token_ids=(tokenizer.eos_id,))
  results = []
  for count in counts:
    started = time.perf_counter()
    routed = local_engine(cfg, params[0], 0, servers=count, router=True)
    launch_s = time.perf_counter() - started
    direct = SGLangEngine(SGLangClient(routed.client.urls), cfg,
                          weights_dir=routed.weights_dir, version=0)
    try:
      paths = {"router": routed, "direct": direct}
      for engine in paths.values():  # the servers compile the batch shapes they meet
        for seed in range(WARMUPS):
          engine.generate(requests, sampling, seed=1000 + seed)
      rates = {name: [] for name in paths}
      for round_ in range(ROUNDS):
        for name in (list(paths) if round_ % 2 == 0 else list(paths)[::-1]):
          began = time.perf_counter()
          out = paths[name].generate(requests, sampling, seed=round_ + 1)
          rates[name].append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - began))
      syncs = [routed.update_weights(params[k % 2], version=k) for k in range(1, SYNCS + 1)]
      versions = {info["weight_version"] for info in routed.client.model_info().values()}
      assert versions == {str(SYNCS)}, versions
    finally:
      direct.client.close()
      routed.close()
    row = {"servers": count, "launch_s": launch_s,
           "router_tokens_per_s": statistics.median(rates["router"]),
           "direct_tokens_per_s": statistics.median(rates["direct"]),
           "weight_sync_s": statistics.median(syncs), "all_rates": rates, "all_syncs": syncs}
    print(f"{count} server(s): router {row['router_tokens_per_s']:8.0f} tokens/s, direct "
          f"{row['direct_tokens_per_s']:8.0f} tokens/s, weight sync {row['weight_sync_s']:.2f} s"
          f" (launch {launch_s:.1f} s)", flush=True)
    results.append(row)
  return results


def trainer_worker(out_path: str) -> None:
  """One process of the trainers part (JAX_* variables say which)."""
  import optax
  from rl import losses
  from rl.packing import trajectory_batch
  from rl.train_step import init_train_state, make_train_step

  distributed.initialize()
  tokenizer = CharTokenizer()
  cfg = config.tiny(tokenizer.vocab_size, **WIDE)
  mesh = sharding.make_mesh(fsdp=jax.device_count())  # starts the backend
  runtime_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  optimizer = optax.adamw(1e-5)
  make = lambda: init_train_state(transformer.init_params(cfg, jax.random.PRNGKey(0)),
                                  optimizer)
  shardings = sharding.state_shardings(jax.eval_shape(make), optimizer, mesh)
  state = jax.jit(make, out_shardings=shardings)()
  step = sharding.on_mesh(mesh, make_train_step(cfg, optimizer, losses.bind("k1.5"),
                                                state_shardings=shardings, donate_state=True))
  rng = np.random.default_rng(0)
  prompt, completion = SEQ // 4, SEQ - SEQ // 4
  batch, _ = trajectory_batch(
      [rng.integers(3, tokenizer.vocab_size, prompt) for _ in range(ROWS)],
      [rng.integers(3, tokenizer.vocab_size, completion) for _ in range(ROWS)],
      [np.full(completion, -4.0, np.float32) for _ in range(ROWS)],
      list(rng.normal(size=ROWS)), [True] * ROWS, SEQ)
  losses_seen, times = [], []
  for i in range(STEPS + 1):
    began = time.perf_counter()
    state, metrics = step(state, sharding.place_rows(batch, mesh))
    losses_seen.append(float(metrics["loss"]))  # waits for the step
    if i:
      times.append(time.perf_counter() - began)
  params = sum(x.size for x in jax.tree.leaves(state.params))
  row = {"process": jax.process_index(), "runtime_rss_gib": runtime_rss,
         "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
         "step_s": statistics.median(times), "losses": losses_seen, "params": params}
  with open(out_path, "w") as f:
    json.dump(row, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def trainers() -> dict:
  results = []
  with tempfile.TemporaryDirectory() as scratch:
    for processes, devices in ((1, 2), (2, 1)):
      port, started = _free_port(), []
      for i in range(processes):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        if processes > 1:
          env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                     JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
        out = os.path.join(scratch, f"{processes}.{i}.json")
        started.append((subprocess.Popen([sys.executable, __file__, "--trainer_worker", out],
                                         env=env, cwd=ROOT), out))
      for process, _ in started:
        if process.wait(timeout=1800):
          raise RuntimeError(f"trainer worker exited with {process.returncode}")
      rows = [json.load(open(out)) for _, out in started]
      for row in rows:
        print(f"{processes} process(es) x {devices} device(s), process {row['process']}: "
              f"peak RSS {row['peak_rss_gib']:.2f} GiB (runtime {row['runtime_rss_gib']:.2f}),"
              f" {row['step_s']:.2f} s/step, losses {row['losses']}", flush=True)
      results.append({"processes": processes, "devices_per_process": devices, "rows": rows})
  one, two = (r["rows"] for r in results)
  diff = max(abs(a - b) for row in two for a, b in zip(one[0]["losses"], row["losses"]))
  ratio = max(r["peak_rss_gib"] for r in two) / one[0]["peak_rss_gib"]
  print(f"{one[0]['params'] / 1e6:.0f}M params; largest loss difference 1 vs 2 processes "
        f"{diff:.2e}; peak RSS per process, 2 processes / 1: {ratio:.2f}")
  return {"runs": results, "max_loss_diff": diff, "peak_rss_ratio": ratio}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default="fleet,trainers")
  parser.add_argument("--servers", default="1,2,4")
  parser.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
  parser.add_argument("--trainer_worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.trainer_worker:
    return trainer_worker(args.trainer_worker)
  parts = args.parts.split(",")
  unknown = sorted(set(parts) - {"fleet", "trainers"})
  if unknown:
    parser.error(f"unknown part(s) {unknown}; valid: fleet, trainers")
  out = {"machine": machine(), "prompts": PROMPTS, "samples": SAMPLES,
         "max_new_tokens": MAX_NEW_TOKENS, "trainer_model": WIDE, "rows": ROWS, "seq": SEQ}
  if "fleet" in parts:
    out["fleet"] = fleet([int(n) for n in args.servers.split(",")])
  if "trainers" in parts:
    out["trainers"] = trainers()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "scaleout.json"), "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
