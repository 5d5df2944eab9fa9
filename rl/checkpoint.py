"""Orbax checkpoints of the whole loop state (params, optimizer, step, RNG, sampler and reward
state). Owns where and how a run's state is saved and found again; nothing else in rl/ does
file I/O on state.

With several processes (models/distributed.py) every process calls save and restore: each
writes and reads its own shards of the global arrays, and orbax commits a step only once all
have written (a step directory without its commit is never listed, so a save cut off by a
kill is never read). The loop's small process-local arrays (step, RNG, sampler and reward
state: the same on every process) are saved as arrays replicated over all devices and come
back process-local. A restore reshards to the `like` state's shardings, so a run can resume
on another number of processes when its mesh fits them.

Every save records what it wrote: process 0, once every process has written and before orbax
commits the step, hashes each file of the step's item directory (arrays and tree metadata;
all but orbax's commit marker, written after) into CHECKSUMS there,
  checkpoints/STEP/default/checksums.json:
    {"hash": "sha256", "files": {"d/4b89...": [size in bytes, hex digest], ...}}
(paths relative to that directory), so a committed step has its checksums; a step saved
before they existed has none and restores unchecked. A restore checks sizes, then hashes,
before orbax reads anything. A step that fails, or that orbax fails to read, is named in one
line ("checkpoint step 20 is corrupt: checkpoints/20/default/d/4b89...: 1234 bytes, expected
5678"), and the state comes from the newest step that restores; the newer ones that did not
are moved to checkpoints.corrupt/STEP (kept, out of orbax's sight, so the run saves those
steps again). When no step restores, CheckpointCorrupt names each and nothing is moved: the
same failure at every step is more likely a run that does not fit its checkpoints than a
disk that lost them all.
"""

import concurrent.futures
import gc
import hashlib
import json
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import distributed

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 20  # bytes hashed at a time
_THREADS = min(8, os.cpu_count() or 1)  # hashlib lets go of the GIL: files hash in parallel
_SETTLE_S = 0.5  # for the reads in flight when one failed (see _newest_good)


class Checkpointer:
  """Step-numbered checkpoints under `directory`, the newest `max_to_keep` kept."""

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_handlers=_ChecksummedHandler())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state) -> None:
    state = distributed.replicated(state, _all_devices())  # several processes only
    self._manager.save(step, args=_Save(state))

  def restore(self, like, step: int | None = None):
    """The state saved at `step`, with the structure of `like`; by default the newest
    checkpoint that verifies and restores, newer ones that do not moved aside (see the module
    docstring). Every process calls it."""
    multi = jax.process_count() > 1
    replicated = jax.sharding.NamedSharding(_all_devices(), jax.sharding.PartitionSpec())
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    # Every leaf gets a sharding here: left to orbax, a leaf without one would take the
    # sharding it was saved with, which names devices of another topology after a change of
    # processes.
    def target(x):
      if multi and not distributed.is_global(x):  # saved replicated over all devices
        placed = replicated
      else:
        placed = x.sharding if isinstance(x, jax.Array) else local
      dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
      return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=placed)

    def read(step: int):
      try:
        restored = self._manager.restore(step, args=_Restore(
            jax.tree.map(target, like)))
      except ValueError as e:
        if "tree structures do not match" not in str(e):
          raise
        raise CheckpointMismatch(self._mismatch(step, like)) from None
      if not multi:
        return restored
      return jax.tree.map(lambda x, ref: x if distributed.is_global(ref)
                          else distributed.process_local(x), restored, like)

    return self._newest_good(read, step, together=True)

  def _mismatch(self, step: int, like) -> str:
    saved = _names(self._manager.item_metadata(step).tree)
    wanted = {tuple(_key_name(k) for k in path[:2])
              for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]}
    depth = 1 if {p[:1] for p in saved} != {p[:1] for p in wanted} else 2
    only_saved = sorted({"/".join(p[:depth]) for p in saved} - {"/".join(p[:depth]) for p in wanted})
    only_here = sorted({"/".join(p[:depth]) for p in wanted} - {"/".join(p[:depth]) for p in saved})
    return (f"the checkpoint {self._manager.directory}/{step} holds a loop state of another "
            f"layout than this run's (only in the checkpoint: {only_saved or 'nothing'}; only "
            f"in this run: {only_here or 'nothing'}). It was written by another version of "
            "longrl (run directories from before the loop redesign, 7d496a1, cannot resume) or "
            "by a run with another rollout source, sampler or reward state. Resume it with the "
            "code and config that wrote it, or start a new run directory from its params: "
            "train.start = @FromRun() with FromRun.path = '<that run directory>'.")

  def restore_params(self, step: int | None = None):
    """Only the policy params of a saved loop state (for evaluation, no optimizer needed):
    of `step`, by default of the newest checkpoint that verifies and restores. The calling
    process checks alone (it may be the only one reading) and moves nothing."""
    # Onto this process's first device, whatever mesh and processes saved it.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def read(step: int):
      abstract = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
          self._manager.item_metadata(step))
      tree = self._manager.restore(step, args=_Restore(abstract))
      return tree["train"]["params"]

    return self._newest_good(read, step, together=False)

  def _newest_good(self, read, step: int | None, *, together: bool):
    """read(step), or by default read(s) of the newest step s whose checksums hold and which
    reads, the newer failing steps moved aside when `together` (every process calls this:
    process 0 checks the files for all, and a step that fails to read on any process fails
    on all). A step that does not restore, or none that does, raises CheckpointCorrupt."""
    saved = sorted(self._manager.all_steps(), reverse=True)
    if not saved:
      raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
    if step is not None and step not in saved:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self._manager.directory} "
                              f"(it holds steps {sorted(saved)})")
    steps = saved if step is None else [step]
    failed = []
    for candidate in steps:
      problem = self._problem(candidate, together)
      value = None
      if problem is None:
        # When one of orbax's asyncio reads fails, the others' errors surface as "Exception
        # ignored" tracebacks (hundreds of lines) while its event loop closes, as TensorStore
        # finishes the reads in flight and as their coroutines are collected; the failure is
        # said here in one line.
        hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
        try:
          value = read(candidate)
        except CheckpointMismatch:
          raise
        except Exception as e:  # noqa: BLE001 - orbax and TensorStore raise many kinds
          problem = f"is unreadable: {_one_line(_first_cause(e))}"
        finally:
          if problem is not None:  # the error and its frames are gone: collect what they held
            time.sleep(_SETTLE_S)
            gc.collect()
          sys.unraisablehook = hook
        if together:
          problem = next((p for p in distributed.gather(problem) if p), None)
      if problem is None:
        break
      failed.append((candidate, f"checkpoint step {candidate} {problem}"))
    else:
      if step is not None:
        raise CheckpointCorrupt(failed[0][1])
      raise CheckpointCorrupt(
          f"no checkpoint in {self._manager.directory} restores, nothing was moved: "
          + "; ".join(line for _, line in failed) + ". The same error at every step suggests "
          "a config other than the one that wrote them; corrupt files leave a fresh start: "
          "move that directory aside, or use another run directory.")
    say = print if distributed.is_primary() else lambda *args: None
    for _, line in failed:
      say(line)
    if failed and together:
      moved = self._set_aside([s for s, _ in failed])
      say(f"moved {', '.join(moved)}; restored step {candidate}, the newest checkpoint that "
          "verifies")
    elif failed:
      say(f"restored step {candidate}, the newest checkpoint that verifies")
    return value

  def _problem(self, step: int, together: bool) -> str | None:
    """What is wrong with `step`'s files (by its checksums), in words, or None."""
    def check():
      directory = os.path.join(self._manager.directory, str(step),
                               ocp.checkpoint_manager.DEFAULT_ITEM_NAME)
      try:
        found = verify_checksums(directory)
      except OSError as e:
        return f"is unreadable: {_one_line(e)}"
      if found is None:
        return None
      shown = os.path.relpath(os.path.join(directory, found[0]),
                              os.path.dirname(self._manager.directory))
      return f"is corrupt: {shown}: {found[1]}"
    if not together:
      return check()
    return distributed.gather(check() if distributed.is_primary() else None)[0]

  def _set_aside(self, steps: list[int]) -> list[str]:
    """Move `steps` (process 0, for all) to checkpoints.corrupt/STEP (STEP.1, ... when that
    is taken); where they went."""
    root = str(self._manager.directory)

    def move():
      moved = []
      for step in steps:
        dest, n = os.path.join(root + ".corrupt", str(step)), 0
        while os.path.exists(dest):
          n += 1
          dest = os.path.join(root + ".corrupt", f"{step}.{n}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(os.path.join(root, str(step)), dest)
        moved.append(f"{os.path.basename(root)}/{step} to "
                     f"{os.path.relpath(dest, os.path.dirname(root))}")
      return moved

    # Every process waits for the moves before it reloads the list of steps.
    moved = distributed.checked(lambda: move() if distributed.is_primary() else [])
    self._manager.reload()
    return moved

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class CheckpointMismatch(ValueError):
  """A run directory's checkpoint does not have the layout of the state restoring it."""


class CheckpointCorrupt(RuntimeError):
  """A checkpoint whose files differ from its checksums, or that orbax cannot read."""


class _ChecksummedHandler(ocp.StandardCheckpointHandler):
  """orbax's handler, which also writes the checksums of what it saved. orbax calls finalize
  on process 0 only, once every process has written, before it commits the step."""

  def finalize(self, directory) -> None:
    super().finalize(directory)
    write_checksums(str(directory))


# orbax finds an item's handler by the type of its arguments.
@ocp.args.register_with_handler(_ChecksummedHandler, for_save=True)
class _Save(ocp.args.StandardSave):
  pass


@ocp.args.register_with_handler(_ChecksummedHandler, for_restore=True)
class _Restore(ocp.args.StandardRestore):
  pass


def write_checksums(directory: str) -> None:
  """CHECKSUMS in `directory`: the size and sha256 of every other file below it."""
  names = sorted(os.path.relpath(os.path.join(root, name), directory)
                 for root, _, files in os.walk(directory) for name in files
                 if name != CHECKSUMS)
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    digests = list(pool.map(lambda name: _sha256(os.path.join(directory, name)), names))
  path = os.path.join(directory, CHECKSUMS)
  with open(path + ".tmp", "w") as f:
    json.dump({"hash": "sha256", "files": dict(zip(names, digests))}, f)
  os.replace(path + ".tmp", path)


def verify_checksums(directory: str) -> tuple[str, str] | None:
  """(a file of `directory`, what is wrong with it: "missing", "N bytes, expected M",
  "sha256 differs") for the first file that differs from CHECKSUMS, or None when all match
  or there are no checksums (a checkpoint saved before them)."""
  path = os.path.join(directory, CHECKSUMS)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return CHECKSUMS, f"unreadable ({_one_line(e)})"
  names = sorted(files)
  for name in names:  # sizes first: a missing or truncated file is found without reading
    full = os.path.join(directory, name)
    if not os.path.isfile(full):
      return name, "missing"
    size = os.path.getsize(full)
    if size != files[name][0]:
      return name, f"{size} bytes, expected {files[name][0]}"
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    digests = pool.map(lambda name: _sha256(os.path.join(directory, name)), names)
    for name, (_, digest) in zip(names, digests):
      if digest != files[name][1]:
        return name, "sha256 differs"
  return None


def _sha256(path: str) -> tuple[int, str]:
  """(size, hex sha256) of the file at `path`."""
  digest, size = hashlib.sha256(), 0
  buffer = bytearray(_CHUNK)
  view = memoryview(buffer)
  with open(path, "rb", buffering=0) as f:
    while n := f.readinto(buffer):
      digest.update(view[:n])
      size += n
  return size, digest.hexdigest()


def _first_cause(error: BaseException) -> BaseException:
  """The error `error` came from, through its chain (orbax wraps TensorStore's, which says
  what it could not read)."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  return error


def _one_line(error: BaseException) -> str:
  """`error` as its type and the first line of its message, at most 400 characters."""
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 400 else text[:397] + "..."


def _key_name(key) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _names(tree, prefix: tuple = ()) -> set[tuple[str, ...]]:
  """The paths, cut at two names, of the leaves of orbax's metadata tree (nested dicts)."""
  if isinstance(tree, dict) and tree:
    return set().union(*(_names(v, prefix + (str(k),)) for k, v in tree.items()))
  if isinstance(tree, (list, tuple)):
    return set().union(set(), *(_names(v, prefix + (str(i),)) for i, v in enumerate(tree)))
  return {prefix[:2]} if not isinstance(tree, dict) else set()


def _all_devices() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(jax.devices(), ("all",))


def save_policy(run_dir: str, params, *, step: int = 0) -> None:
  """Save `params` alone as `run_dir`'s checkpoint (a model made outside the RL loop, e.g. by
  long2short), readable by `load_policy`, experiments.evaluation.evaluate_checkpoint and
  `train(start=FromRun(run_dir))`."""
  checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=1)
  checkpointer.save(step, {"train": {"params": params}})
  checkpointer.close()


def load_policy(run_dir: str, like=None):
  """The policy params of `run_dir`'s latest checkpoint (an RL run or a `save_policy`).
  With `like` (params of the model config to be used), the tree and every shape must match."""
  directory = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{run_dir} has no checkpoints/ directory")
  checkpointer = Checkpointer(directory)
  params = checkpointer.restore_params()
  checkpointer.close()
  if like is not None:
    want = jax.tree.map(lambda x: tuple(x.shape), like)
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if want != got:
      keys = [path[-1] for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
      if all(getattr(key, "key", None) in ("a", "b") for key in keys):
        raise ValueError(f"{run_dir} holds LoRA adapters (a LoRA run's checkpoints), not a "
                         "model's params; starting from them is not supported yet (a LoRA run "
                         "from a Hugging Face checkpoint exports its merged weights to "
                         "run_dir/hf, a start of its own)")
      raise ValueError(f"the params in {run_dir} do not fit this model config (saved shapes "
                       f"{got}, expected {want})")
    params = jax.tree.map(lambda x, ref: jax.numpy.asarray(x, ref.dtype), params, like)
  return params
