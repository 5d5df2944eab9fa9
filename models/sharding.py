"""Device meshes for training.

Owns the mesh axes and how a run enters a mesh. The axes are, outermost first:
  data     replicas that each see different rows
  fsdp     rows split like data; parameters sharded across it
  tensor   attention heads and MLP columns split
  context  the sequence split (ring attention, models/attention/ring.py)
Axis types are Auto: shardings propagate from the inputs and from the shard_map boundaries of
ring attention, so model code needs no annotation to run on a mesh.
"""

import contextlib
import functools
import math

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor", "context")


class MeshUnavailable(ValueError):
  """The requested mesh does not fit the devices present."""


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, context: int = 1) -> Mesh:
  """A mesh over the first data x fsdp x tensor x context devices."""
  shape = (data, fsdp, tensor, context)
  if min(shape) < 1:
    raise ValueError(f"mesh sizes must be >= 1, got {dict(zip(AXES, shape))}")
  devices = jax.devices()
  need = math.prod(shape)
  if need > len(devices):
    raise MeshUnavailable(
        f"mesh {dict(zip(AXES, shape))} needs {need} devices; {len(devices)} "
        f"{jax.default_backend()} device(s) found. On CPU, simulate more with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={need}")
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices[:need])


def use(mesh: Mesh | None):
  """Context manager entering `mesh` (nothing when None)."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def on_mesh(mesh: Mesh | None, fn):
  """`fn` called (and so traced) inside `mesh`."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.set_mesh(mesh):
      return fn(*args, **kwargs)

  return wrapped
