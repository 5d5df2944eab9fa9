"""Seconds that checksums add to a checkpoint's save and restore (rl/checkpoint.py). Not a test.

  python bench/checkpoint_verify.py [--states quickstart,qwen2.5-1.5b] [--dir /tmp]
      [--out bench/results]                            # ~3 minutes on 2 CPU cores

Two states, saved and restored by rl.checkpoint.Checkpointer (checksums written at the save,
checked at the restore) and by a bare orbax CheckpointManager with the same options (neither):
  quickstart    the loop's train state of the quickstart model (models.config.tiny at
                experiments/configs/quickstart.gin's sizes): params + AdamW's two moments
                + the step, float32; the median of 5 saves and restores
  qwen2.5-1.5b  a Qwen2.5-1.5B-shaped model's params (bench/memory.py CONFIGS), float32
                arrays of random values (zstd shrinks them little, as it does trained
                weights): 1.54B params, 6.2 GB; the mean of 2 saves and restores, which of
                the two kinds goes first alternating
A save is timed until orbax has committed it (Checkpointer.close waits for the background
write, in which the checksums are written: a training loop waits for it only at its next
save), a restore until the arrays are in memory. The end-to-end difference is noisy (the disk,
the page cache), so the part verification takes is also timed alone on the saved step:
write_checksums (the save's share) and verify_checksums (the restore's), with their
throughput (sha256 on all cores). The files are in the page cache after a save, as they are
when a run resumes on the machine that wrote them; from a cold disk or a network file
system, the check reads them once more.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from bench.memory import model_config  # noqa: E402
from models import config, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import checkpoint, loop  # noqa: E402
from rl.train_step import init_train_state  # noqa: E402

GB = 1e9


def quickstart_state():
  cfg = config.tiny(CharTokenizer().vocab_size, hidden_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=384)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  return jax.device_get(init_train_state(params, loop.rl_optimizer(1e-4)))


def qwen_params():
  cfg = model_config("qwen2.5-1.5b")
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: rng.random(s.shape, np.float32), shapes)


def timed(fn):
  start = time.perf_counter()
  value = fn()
  return time.perf_counter() - start, value


def bare_save(directory, state):
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=2, create=True), item_handlers=ocp.StandardCheckpointHandler())
  manager.save(1, args=ocp.args.StandardSave(state))
  manager.close()


def bare_restore(directory, like):
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=2), item_handlers=ocp.StandardCheckpointHandler())
  restored = manager.restore(1, args=ocp.args.StandardRestore(like))
  manager.close()
  return restored


def verified_save(directory, state):
  saver = checkpoint.Checkpointer(directory)
  saver.save(1, state)
  saver.close()


def verified_restore(directory, like):
  restorer = checkpoint.Checkpointer(directory)
  restored = restorer.restore(like, step=1)
  restorer.close()
  return restored


def measure(name: str, make, repeats: int, root: str) -> dict:
  state = make()
  nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                     sharding=device), state)
  times = {key: [] for key in ("save_bare", "save_verified", "restore_bare",
                               "restore_verified", "write_checksums", "verify_checksums")}
  files = stored = 0
  for i in range(repeats):
    bare, verified = (os.path.join(root, f"{name}-{kind}-{i}") for kind in ("bare", "verified"))
    # Which goes first alternates: a machine's first large write of a process is slower.
    saves = [("bare", lambda: bare_save(bare, state)),
             ("verified", lambda: verified_save(verified, state))]
    for kind, save in saves if i % 2 == 0 else saves[::-1]:
      times[f"save_{kind}"].append(timed(save)[0])
    item = os.path.join(verified, "1", "default")
    # The save's share, again on the same files (it overwrites the checksums it wrote).
    times["write_checksums"].append(timed(lambda: checkpoint.write_checksums(item))[0])
    times["verify_checksums"].append(timed(lambda: checkpoint.verify_checksums(item))[0])
    listed = json.load(open(os.path.join(item, checkpoint.CHECKSUMS)))["files"]
    files, stored = len(listed), sum(size for size, _ in listed.values())
    if i == repeats - 1:
      del state  # the restores' memory
    restores = [("bare", bare, bare_restore), ("verified", verified, verified_restore)]
    for kind, path, restore in restores if i % 2 == 0 else restores[::-1]:
      seconds, restored = timed(lambda: jax.block_until_ready(restore(path, like)))
      times[f"restore_{kind}"].append(seconds)
      del restored
    shutil.rmtree(bare)
    shutil.rmtree(verified)
  median = {key: statistics.median(values) for key, values in times.items()}
  return {"state": name, "bytes": nbytes, "stored_bytes": stored, "files": files,
          "repeats": repeats, **median,
          "save_added": median["save_verified"] - median["save_bare"],
          "restore_added": median["restore_verified"] - median["restore_bare"],
          "write_checksums_gb_s": stored / GB / median["write_checksums"],
          "verify_checksums_gb_s": stored / GB / median["verify_checksums"]}


STATES = {"quickstart": (quickstart_state, 5), "qwen2.5-1.5b": (qwen_params, 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--states", default=",".join(STATES))
  parser.add_argument("--dir", default=tempfile.gettempdir(),
                      help="where the checkpoints are written (and removed)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="checkpoint-verify-", dir=args.dir)
  rows = []
  print(f"{'state':>13} {'memory':>7} {'on disk':>7} {'files':>5} | {'save: orbax':>11} "
        f"{'checked':>8} "
        f"{'added':>7} {'hashing':>8} {'GB/s':>5} | {'restore: orbax':>14} {'checked':>8} "
        f"{'added':>7} {'verify':>8} {'GB/s':>5}")
  try:
    for name in args.states.split(","):
      make, repeats = STATES[name]
      r = measure(name, make, repeats, root)
      rows.append(r)
      print(f"{name:>13} {r['bytes'] / GB:5.3f}GB {r['stored_bytes'] / GB:5.3f}GB "
            f"{r['files']:5d} | "
            f"{r['save_bare']:10.3f}s {r['save_verified']:7.3f}s {r['save_added']:+6.3f}s "
            f"{r['write_checksums']:7.3f}s {r['write_checksums_gb_s']:5.2f} | "
            f"{r['restore_bare']:13.3f}s {r['restore_verified']:7.3f}s "
            f"{r['restore_added']:+6.3f}s {r['verify_checksums']:7.3f}s "
            f"{r['verify_checksums_gb_s']:5.2f}", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "checkpoint_verify.json"), "w") as f:
    json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
