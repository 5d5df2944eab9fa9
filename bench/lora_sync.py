"""A LoRA run's weight sync against a full one on this machine, not a test: the bytes and
seconds of one adapter sync (SGLangEngine.update_adapters: a PEFT directory written and
loaded by every server under a new name) against one full sync (update_weights: a Hugging
Face checkpoint exported and loaded from disk), at a real model's shape.

  python bench/lora_sync.py [--models qwen2.5-0.5b] [--rank 32] [--dir /dev/shm]
                            [--out bench/results] [--small]

(writes bench/results/lora_sync.json)

For each model shape (bench/memory.py's CONFIGS: random float32 master weights, bf16
compute), one `python -m rollouts.server` process starts from its bf16 export with
--dtype bfloat16 --enable-lora (as local_engine starts it), and the median of SYNCS syncs of
each kind is timed: full (export in bf16, pause, /update_weights_from_disk, continue, check)
and adapter (every projection at --rank, alpha = rank, written in float32 as PEFT writes it,
then /load_lora_adapter, and the version two back unloaded; the write is also timed alone).
Our server merges a loaded adapter into a copy of its weights (rollouts/server/adapters.py),
which SGLang does not: its load is a copy of the adapter's tensors into a pool. --small: a
2-layer model of the same width, for a check that the script runs.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402

from memory import CONFIGS  # noqa: E402
from models import hf, hf_lora, lora, transformer  # noqa: E402
from rollouts.server.main import launch  # noqa: E402
from rollouts.sglang import SGLangClient  # noqa: E402
from rollouts.sglang_engine import LORA_MAX_RANK, SGLangEngine  # noqa: E402

SYNCS = 3
MIB = 2**20


def _bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def measure(name: str, rank: int, directory: str, small: bool) -> dict:
  shape = dict(CONFIGS[name])
  if small:
    shape.update(num_hidden_layers=2)
  cfg = hf.config_from_hf(shape, dtype="bfloat16", param_dtype="float32")
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  lora_cfg = lora.LoraConfig(rank=rank, alpha=float(rank))
  adapters = lora.init_adapters(params, lora_cfg, cfg, jax.random.PRNGKey(1))
  weights = tempfile.mkdtemp(prefix="lora-sync-", dir=directory)
  process = None
  try:
    engine = SGLangEngine(SGLangClient(["http://127.0.0.1:9"]), cfg, weights_dir=weights)
    start = engine.export(params, 0)
    engine.close()
    process, url = launch(["--hf_checkpoint", start, "--weight_version", "0", "--dtype",
                           "bfloat16", "--enable-lora", "--max-lora-rank",
                           str(LORA_MAX_RANK), "--lora-target-modules", "all"], timeout=900)
    engine = SGLangEngine(SGLangClient([url], control_timeout=900), cfg, weights_dir=weights,
                          weights_path=start)
    full = [engine.update_weights(params, version) for version in range(1, SYNCS + 1)]
    full_bytes = _bytes(engine.weights_path)
    version = SYNCS + 1
    engine.update_adapters(adapters, lora_cfg, version, base=lambda: params)  # the base once
    adapter = [engine.update_adapters(adapters, lora_cfg, v, base=lambda: params)
               for v in range(version + 1, version + 1 + SYNCS)]
    adapter_bytes = _bytes(os.path.join(weights, f"a{version + SYNCS:06d}"))
    write = [_timed(lambda: hf_lora.save_adapter(adapters, cfg, lora_cfg,
                                                 os.path.join(weights, "write")))
             for _ in range(SYNCS)]
    engine.client.close()
    full_s, adapter_s = statistics.median(full), statistics.median(adapter)
    return {"model": name + (" (2 layers)" if small else ""), "rank": rank,
            "trained": lora.count(adapters), "full_mib": full_bytes / MIB, "full_s": full_s,
            "adapter_mib": adapter_bytes / MIB, "adapter_s": adapter_s,
            "adapter_write_s": statistics.median(write),
            "bytes_ratio": full_bytes / adapter_bytes, "seconds_ratio": full_s / adapter_s}
  finally:
    if process is not None:
      process.kill()
      process.wait()
    shutil.rmtree(weights, ignore_errors=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="qwen2.5-0.5b")
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  results = []
  print(f"{'model':<24}{'rank':>5}{'full MiB':>10}{'full s':>8}{'adapter MiB':>13}"
        f"{'adapter s':>11}{'write s':>9}{'bytes x':>9}{'seconds x':>11}")
  for name in args.models.split(","):
    r = measure(name, args.rank, args.dir, args.small)
    results.append(r)
    print(f"{r['model']:<24}{r['rank']:>5}{r['full_mib']:>10.1f}{r['full_s']:>8.2f}"
          f"{r['adapter_mib']:>13.1f}{r['adapter_s']:>11.2f}{r['adapter_write_s']:>9.2f}"
          f"{r['bytes_ratio']:>9.1f}"
          f"{r['seconds_ratio']:>11.1f}", flush=True)
  if not args.small:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lora_sync.json"), "w") as f:
      json.dump({"dir": args.dir, "syncs": SYNCS, "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
