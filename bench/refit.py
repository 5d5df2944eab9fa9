"""A refit on this machine, not a test: one weight sync of a real model's shape to our servers,
against what writing its bytes costs here.

  python bench/refit.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--servers 1,2]
                        [--dir /dev/shm] [--out bench/results] [--small]

(writes bench/results/refit_<dir's name>.json)

For each model shape (bench/memory.py's CONFIGS: random float32 master weights, bf16 compute),
`python -m rollouts.server` processes (1, then 2) start from its bf16 export with
--dtype bfloat16, and SGLangEngine.update_weights does what the loop does every step: export
a Hugging Face checkpoint in bf16 (models/hf.save, its shards written in parallel) under
--dir, then on every server in parallel pause, /update_weights_from_disk, continue and check
the version. Reported, the median of SYNCS syncs: the export's seconds, the servers' (load,
continue, check), the whole sync's, and the limit: the seconds this machine takes to write the
export's bytes to the same directory (numpy's tofile, one thread, the same total size in
files of the export's shard size; the median of SYNCS), as a ratio limit / export (1.0: as
fast as the disk). The servers here share this machine's cores (2 here), so 2 servers load
no faster than 1; on a GPU node each has its own.
--dir defaults to /dev/shm (memory-backed, as a trainer and servers on one host share one);
a disk directory measures the disk. --small: a 2-layer model of the same width, for a check
that the script runs.
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
import numpy as np  # noqa: E402

from memory import CONFIGS  # noqa: E402
from models import hf, transformer  # noqa: E402
from rollouts.server.main import launch  # noqa: E402
from rollouts.sglang import SGLangClient  # noqa: E402
from rollouts.sglang_engine import EXPORT_SHARD_BYTES, SGLangEngine  # noqa: E402

SYNCS = 3
GIB = 2**30


def write_limit(directory: str, total_bytes: int, shard_bytes: int) -> float:
  """Seconds to write `total_bytes` to `directory` in files of up to `shard_bytes` (one
  thread, numpy's tofile, the files removed after): the bandwidth a refit writes against."""
  scratch = tempfile.mkdtemp(prefix="refit-limit-", dir=directory)
  chunk = np.ones(min(shard_bytes, total_bytes), np.uint8)
  try:
    started = time.perf_counter()
    left, k = total_bytes, 0
    while left > 0:
      chunk[:min(left, chunk.size)].tofile(os.path.join(scratch, f"{k}.bin"))
      left, k = left - chunk.size, k + 1
    return time.perf_counter() - started
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def measure(name: str, servers: int, directory: str, small: bool) -> dict:
  shape = dict(CONFIGS[name])
  if small:
    shape.update(num_hidden_layers=2)
  cfg = hf.config_from_hf(shape, dtype="bfloat16", param_dtype="float32")
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  weights = tempfile.mkdtemp(prefix="refit-", dir=directory)
  processes = []
  try:
    engine = SGLangEngine(SGLangClient(["http://127.0.0.1:9"]), cfg, weights_dir=weights)
    start = engine.export(params, 0)
    engine.close()
    for _ in range(servers):
      processes.append(launch(["--hf_checkpoint", start, "--weight_version", "0",
                               "--dtype", "bfloat16"], timeout=900))
    client = SGLangClient([url for _, url in processes], control_timeout=900)
    engine = SGLangEngine(client, cfg, weights_dir=weights, weights_path=start)
    rows = []
    for version in range(1, SYNCS + 1):
      started = time.perf_counter()
      path = engine.export(params, version)
      exported = time.perf_counter() - started
      synced = client.sync_weights(path, version)
      rows.append((exported, synced, exported + synced))
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                 if f.endswith(".safetensors"))
    limit = statistics.median(write_limit(directory, nbytes, EXPORT_SHARD_BYTES)
                              for _ in range(SYNCS))
    client.close()
    export_s, sync_s, total_s = (statistics.median(column) for column in zip(*rows))
    return {"model": name + (" (2 layers)" if small else ""), "servers": servers,
            "gib": nbytes / GIB, "export_s": export_s, "servers_s": sync_s, "total_s": total_s,
            "write_limit_s": limit, "limit_over_export": limit / export_s}
  finally:
    for process, _ in processes:
      process.kill()
      process.wait()
    shutil.rmtree(weights, ignore_errors=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
  parser.add_argument("--servers", default="1,2")
  parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  results = []
  print(f"{'model':<24}{'servers':>8}{'GiB':>7}{'export':>9}{'servers':>9}{'total':>9}"
        f"{'limit':>9}{'limit/export':>14}")
  for name in args.models.split(","):
    for servers in map(int, args.servers.split(",")):
      r = measure(name, servers, args.dir, args.small)
      results.append(r)
      print(f"{r['model']:<24}{servers:>8}{r['gib']:>7.2f}{r['export_s']:>8.2f}s"
            f"{r['servers_s']:>8.2f}s{r['total_s']:>8.2f}s{r['write_limit_s']:>8.2f}s"
            f"{r['limit_over_export']:>14.2f}", flush=True)
  if not args.small:
    os.makedirs(args.out, exist_ok=True)
    name = f"refit_{os.path.basename(os.path.normpath(args.dir))}.json"  # refit_shm.json
    with open(os.path.join(args.out, name), "w") as f:
      json.dump({"dir": args.dir, "syncs": SYNCS, "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
