"""A hybrid deployment's switches on this machine, not a test: the memory and seconds of each
turn at a real model's shape.

  python bench/hybrid.py [--models qwen2.5-0.5b] [--dir /dev/shm]
                         [--out bench/results] [--small]

(writes bench/results/hybrid.json)

For each model shape (bench/memory.py's CONFIGS, random weights, bf16 compute), what
rl.loop does around a step's generation with RLConfig.hybrid, each call timed alone:
  server    `python -m rollouts.server --dtype bfloat16 --enable-memory-saver` on the model's
            bf16 export, one request served; then SGLangEngine.release_memory (pause, release
            all tags) and SGLangEngine.update_weights (export, resume the weights, load,
            resume the KV cache, continue): the server process's resident memory before the
            release, after it and after the update.
  embedded  a JaxEngine holding a bf16 copy of float32 params (a process of its own):
            release_memory and update_weights, the process's resident memory at each point.
  trainer   the train state (float32 params and AdamW's two moments) to pinned host memory
            and back (models.sharding.in_memory: the loop's offload_s and reload_s). On a CPU
            host and device memory are one, so only the seconds mean something here.
The switches as the loop reports them: switch_to_train_s = release_s + reload_s and
switch_to_inference_s = offload_s + the update's seconds (weight_sync_s). --small: a 2-layer
model of the same width, a check that the script runs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import httpx  # noqa: E402
import jax  # noqa: E402

from memory import CONFIGS  # noqa: E402
from models import hf, sharding, transformer  # noqa: E402
from rl.loop import rl_optimizer  # noqa: E402
from rl.train_step import init_train_state  # noqa: E402
from rollouts.server.main import launch  # noqa: E402
from rollouts.sglang import SGLangClient  # noqa: E402
from rollouts.sglang_engine import SGLangEngine  # noqa: E402

MIB = 2**20

# The embedded engine in a process of its own (its resident memory is the engine's alone).
_EMBEDDED = """
import json, sys, time, jax
from models import hf, transformer
from rollouts.jax_engine import JaxEngine
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
cfg = hf.config_from_hf(json.loads(sys.argv[1]), dtype="bfloat16", param_dtype="float32")
params = transformer.init_params(cfg, jax.random.PRNGKey(0))
engine = JaxEngine(cfg, params, dtype="bfloat16")
jax.block_until_ready(engine.params)
row = {"rss_before_mib": rss()}
row["release_s"] = engine.release_memory()
row["rss_released_mib"] = rss()
started = time.perf_counter()
engine.update_weights(params, 1)
jax.block_until_ready(engine.params)
row.update(update_s=time.perf_counter() - started, rss_resumed_mib=rss())
print(json.dumps(row))
"""


def _rss_mib(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def server_row(cfg, params, directory: str) -> dict:
  weights = tempfile.mkdtemp(prefix="hybrid-", dir=directory)
  process = None
  try:
    exporter = SGLangEngine(SGLangClient(["http://127.0.0.1:9"]), cfg, weights_dir=weights)
    start = exporter.export(params, 0)
    exporter.close()
    process, url = launch(["--hf_checkpoint", start, "--weight_version", "0", "--dtype",
                           "bfloat16", "--enable-memory-saver"], timeout=900)
    httpx.post(url + "/generate", timeout=900, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
    engine = SGLangEngine(SGLangClient([url], control_timeout=900), cfg, weights_dir=weights,
                          weights_path=start)
    row = {"rss_before_mib": _rss_mib(process.pid)}
    row["release_s"] = engine.release_memory()
    row["rss_released_mib"] = _rss_mib(process.pid)
    row["update_s"] = engine.update_weights(params, 1)
    row["rss_resumed_mib"] = _rss_mib(process.pid)
    engine.client.close()
    return row
  finally:
    if process is not None:
      process.kill()
      process.wait()
    shutil.rmtree(weights, ignore_errors=True)


def embedded_row(shape: dict) -> dict:
  done = subprocess.run([sys.executable, "-c", _EMBEDDED, json.dumps(shape)], cwd=ROOT,
                        capture_output=True, text=True, timeout=1800)
  if done.returncode:
    raise RuntimeError(f"the embedded engine's process failed: {done.stderr[-2000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def trainer_row(params) -> dict:
  state = jax.block_until_ready(init_train_state(params, rl_optimizer(1e-6)))
  row = {"state_gib": sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30}
  started = time.perf_counter()
  state = sharding.in_memory(state, "pinned_host")
  row["offload_s"] = time.perf_counter() - started
  started = time.perf_counter()
  state = sharding.in_memory(state, "device")
  row["reload_s"] = time.perf_counter() - started
  return row


def measure(name: str, directory: str, small: bool) -> dict:
  shape = dict(CONFIGS[name])
  if small:
    shape.update(num_hidden_layers=2)
  cfg = hf.config_from_hf(shape, dtype="bfloat16", param_dtype="float32")
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  out = {"model": name + (" (2 layers)" if small else ""),
         "weights_bf16_mib": sum(x.size for x in jax.tree.leaves(params)) * 2 / MIB,
         "server": server_row(cfg, params, directory), "embedded": embedded_row(shape),
         "trainer": trainer_row(params)}
  for engine in ("server", "embedded"):
    out[engine]["switch_to_train_s"] = out[engine]["release_s"] + out["trainer"]["reload_s"]
    out[engine]["switch_to_inference_s"] = (out["trainer"]["offload_s"]
                                            + out[engine]["update_s"])
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="qwen2.5-0.5b")
  parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  results = []
  print(f"{'model':<24}{'engine':>9}{'weights':>9}{'RSS before':>12}{'released':>10}"
        f"{'resumed':>9}{'release':>9}{'update':>8}{'to train':>10}{'to infer':>10}")
  for name in args.models.split(","):
    r = measure(name, args.dir, args.small)
    results.append(r)
    for engine in ("server", "embedded"):
      e = r[engine]
      print(f"{r['model']:<24}{engine:>9}{r['weights_bf16_mib']:>7.0f}Mi"
            f"{e['rss_before_mib']:>10.0f}Mi{e['rss_released_mib']:>8.0f}Mi"
            f"{e['rss_resumed_mib']:>7.0f}Mi{e['release_s']:>8.2f}s{e['update_s']:>7.2f}s"
            f"{e['switch_to_train_s']:>9.2f}s{e['switch_to_inference_s']:>9.2f}s", flush=True)
    t = r["trainer"]
    print(f"{'':<24}{'trainer':>9}  state {t['state_gib']:.2f} GiB: offload "
          f"{t['offload_s']:.2f} s, reload {t['reload_s']:.2f} s", flush=True)
  if not args.small:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hybrid.json"), "w") as f:
      json.dump({"dir": args.dir, "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
