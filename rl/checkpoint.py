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
