"""Run an experiment from gin files: `python experiments/run.py --gin FILE [--gin FILE ...]
[--gin_param BINDING ...] [--run_dir DIR]`.

Every file and binding is checked before anything is built or compiled: a missing file, an
unknown configurable or parameter, or an unknown loss name stops the run with a message
naming it. The operative config is logged and written to RUN_DIR/config.gin.

Several processes (one per host; on CPU, several on one host with simulated devices): start
the same command in each, with JAX_COORDINATOR_ADDRESS=HOST:PORT (process 0's host),
JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i set (or the `initialize.*` bindings), and a
`train.mesh` over all their devices. Process 0 prints and writes; all train.

A rollout server fleet or router that fails mid-run (every server down, the router gone)
ends the run with the error and the checkpoint the same command resumes from.

`--gin_param "RLConfig.deterministic = True"`: a reproducible run (rl.config.RLConfig), with XLA's
deterministic GPU operations set here, before JAX starts its backend (the only time XLA reads
XLA_FLAGS). scripts/check_determinism.py runs a config twice and names the first difference.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402

from experiments import gin_externals  # noqa: E402
from models import host_allocator  # noqa: E402
from models.attention.dispatch import KernelUnavailable  # noqa: E402
from models.distributed import CoordinatorUnreachable, ProcessFailed, is_primary  # noqa: E402
from models.sharding import MeshUnavailable  # noqa: E402
from rl import ConfigError  # noqa: E402
from rl.checkpoint import CheckpointCorrupt  # noqa: E402
from rl.run_lock import RunDirectoryBusy  # noqa: E402
from rl.sources import RolloutsFailed  # noqa: E402
from rl.trainer import make_deterministic  # noqa: E402
from rollouts.sglang import ServerError  # noqa: E402
from rollouts.sglang_engine import Unservable  # noqa: E402


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", default=[], metavar="FILE",
                      help="gin config file; repeatable, later files override earlier ones")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING",
                      help="one gin binding, e.g. \"train.num_steps = 10\"; repeatable")
  parser.add_argument("--run_dir", help="overrides train.run_dir")
  args = parser.parse_args(argv)
  if not args.gin:
    parser.error("give at least one --gin FILE (e.g. experiments/configs/quickstart.gin)")
  return args


def load_config(files, bindings, run_dir=None):
  """Parse gin files and bindings strictly; returns the run directory."""
  for path in files:
    if not os.path.isfile(path):
      raise SystemExit(f"error: gin config file not found: {path}")
  if run_dir:
    bindings = [*bindings, f"train.run_dir = {run_dir!r}"]
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
  except (ValueError, KeyError, TypeError, SyntaxError) as e:
    raise SystemExit(f"error in gin config: {e}") from None
  try:
    return gin.query_parameter("train.run_dir")
  except ValueError:
    raise SystemExit("error: no run directory; bind train.run_dir or pass --run_dir") from None


def deterministic() -> bool:
  """Whether the parsed config asks for a reproducible run (RLConfig.deterministic)."""
  try:
    return bool(gin.query_parameter("RLConfig.deterministic"))
  except ValueError:  # not bound
    return False


def resume_hint(run_dir: str) -> str:
  """Where a run that stopped on a fault can resume from."""
  directory = os.path.join(run_dir, "checkpoints")
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(
      directory) else []
  if not steps:
    return "No checkpoint was written; running the same command starts the run again."
  return (f"The last checkpoint is RL step {max(steps)} in {directory}: running the same "
          "command resumes from it.")


def main(argv=None):
  host_allocator.keep_freed_memory()  # before JAX starts its CPU backend
  args = parse_args(argv if argv is not None else sys.argv[1:])
  run_dir = load_config(args.gin, args.gin_param, args.run_dir)
  try:
    if deterministic():
      make_deterministic()  # before JAX starts its backend, when XLA reads XLA_FLAGS
    # Before the mesh is built (train.mesh = @make_mesh()): JAX's backend must start knowing
    # every process.
    gin_externals.initialize()
  except (ValueError, CoordinatorUnreachable, ConfigError) as e:
    raise SystemExit(f"error: {e}") from None
  if is_primary():
    print(gin.config_str())
  try:
    summary = gin_externals.train()  # validates its configuration before any compile
  except (ConfigError, KernelUnavailable, MeshUnavailable, RunDirectoryBusy,
          CheckpointCorrupt, Unservable) as e:
    raise SystemExit(f"error: {e}") from None
  except (ServerError, ProcessFailed, RolloutsFailed) as e:  # a fault mid-run, and what next
    raise SystemExit(f"error: {e}\n{resume_hint(run_dir)}") from None
  if is_primary():
    with open(os.path.join(run_dir, "config.gin"), "w") as f:
      f.write(gin.operative_config_str())
  return summary


if __name__ == "__main__":
  main()
