"""Orbax checkpoints of the whole loop state (params, optimizer, step, RNG, sampler and reward
state). Owns where and how a run's state is saved and found again; nothing else in rl/ does
file I/O on state."""

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Step-numbered checkpoints under `directory`, the newest `max_to_keep` kept."""

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state))

  def restore(self, like, step: int | None = None):
    """The state saved at `step` (default: the latest), with the structure of `like`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def restore_params(self, step: int | None = None):
    """Only the policy params of a saved loop state (for evaluation, no optimizer needed)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
    tree = self._manager.restore(step, args=ocp.args.StandardRestore())
    return tree["train"]["params"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def save_policy(run_dir: str, params, *, step: int = 0) -> None:
  """Save `params` alone as `run_dir`'s checkpoint (a model made outside the RL loop, e.g. by
  long2short), readable by `load_policy`, rl.eval.evaluate_checkpoint and
  `train(init_from=run_dir)`."""
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
