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
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import distributed


class Checkpointer:
  """Step-numbered checkpoints under `directory`, the newest `max_to_keep` kept."""

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state) -> None:
    state = distributed.replicated(state, _all_devices())  # several processes only
    self._manager.save(step, args=ocp.args.StandardSave(state))

  def restore(self, like, step: int | None = None):
    """The state saved at `step` (default: the latest), with the structure of `like`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
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

    try:
      restored = self._manager.restore(step, args=ocp.args.StandardRestore(
          jax.tree.map(target, like)))
    except ValueError as e:
      if "tree structures do not match" not in str(e):
        raise
      raise CheckpointMismatch(self._mismatch(step, like)) from None
    if not multi:
      return restored
    return jax.tree.map(lambda x, ref: x if distributed.is_global(ref)
                        else distributed.process_local(x), restored, like)

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
    """Only the policy params of a saved loop state (for evaluation, no optimizer needed)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
    # Onto this process's first device, whatever mesh and processes saved it.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            self._manager.item_metadata(step))
    tree = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return tree["train"]["params"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class CheckpointMismatch(ValueError):
  """A run directory's checkpoint does not have the layout of the state restoring it."""


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
      raise ValueError(f"the params in {run_dir} do not fit this model config (saved shapes "
                       f"{got}, expected {want})")
    params = jax.tree.map(lambda x, ref: jax.numpy.asarray(x, ref.dtype), params, like)
  return params
