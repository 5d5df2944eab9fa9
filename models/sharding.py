"""Device meshes, logical axis names and the one table that maps them to mesh axes.

Owns the mesh axes, how a run enters a mesh, and where a batch's rows go on it. The axes
are, outermost first:
  data     replicas that each see different rows
  fsdp     rows split like data; parameters (and optimizer state) sharded across it
  expert   rows split like data, and a mixture's experts split across it: each device runs
           the experts it holds on the tokens routed to them, which its peers send it
           (all-to-all: models/mixture.py, expert_parallel_experts)
  tensor   attention heads, MLP columns and the vocabulary split
  context  the sequence split (ring attention, models/attention/ring.py)
Model code names the axes of every parameter and activation logically (`EMBED`, `HEADS`, ...);
`RULES` maps logical names to mesh axes. A mesh axis that does not divide a dimension is
dropped for that dimension, and `check_sharded` refuses a mesh that leaves a large weight
whole on every device. Axis types are Auto: XLA propagates shardings between the annotations.
"""

import contextlib
import functools
import math
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# Logical axes of parameters.
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP = "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"
EXPERTS = "experts"  # a mixture's stacked experts
# Logical axes of activations.
BATCH, SEQ, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, ACT_MLP = (
    "batch", "seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp")

RULES: dict[str, tuple[str, ...]] = {
    VOCAB: ("tensor",), EMBED: ("fsdp",), HEADS: ("tensor",), KV_HEADS: ("tensor",),
    HEAD_DIM: (), MLP: ("tensor",), EXPERTS: ("expert",),
    BATCH: ("data", "fsdp", "expert"), SEQ: ("context",), ACT_EMBED: (), ACT_HEADS: ("tensor",),
    ACT_KV_HEADS: ("tensor",), ACT_MLP: ("tensor",),
}

AXES = ("data", "fsdp", "expert", "tensor", "context")


class MeshUnavailable(ValueError):
  """The requested mesh does not fit the devices present."""


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, context: int = 1,
              expert: int = 1) -> Mesh:
  """A mesh over the first data x fsdp x expert x tensor x context devices."""
  shape = (data, fsdp, expert, tensor, context)
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


def place_rows(tree, mesh: Mesh):
  """Host arrays whose first dimension is rows (a TrainBatch), the same on every process, as
  global arrays with their rows split over data and fsdp (as BATCH). Each process builds
  only the rows of its own devices (jax.make_array_from_callback), so none transfers the
  whole batch; with one process the rows go straight to their devices."""
  def place(x):
    x = np.asarray(x)
    target = NamedSharding(mesh, spec((BATCH,) + (None,) * (x.ndim - 1), x.shape, mesh))
    return jax.make_array_from_callback(x.shape, target, lambda index: x[index])
  return jax.tree.map(place, tree)


def spec(logical_axes, shape, mesh) -> P:
  """PartitionSpec for an array of `shape` whose dimensions are named `logical_axes` (None =
  never sharded). Mesh axes of size 1, already used, or not dividing the dimension are left
  out, so every spec is valid for its array."""
  used, out = set(), []
  for name, size in zip(logical_axes, shape):
    axes = []
    for axis in RULES[name] if name is not None else ():
      n = mesh.shape.get(axis, 1)
      if n > 1 and axis not in used and size % (n * math.prod(mesh.shape[a] for a in axes)) == 0:
        axes.append(axis)
        used.add(axis)
    out.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
  return P(*out)


def constrain(x, *logical_axes):
  """Pin activation `x`'s sharding to its logical axes under the current mesh (no-op without
  one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical_axes, x.shape, mesh))


_PARAM_AXES = {
    ("embed_tokens", "embedding"): (VOCAB, EMBED),
    ("q_proj", "kernel"): (EMBED, HEADS, HEAD_DIM), ("q_proj", "bias"): (HEADS, HEAD_DIM),
    ("k_proj", "kernel"): (EMBED, KV_HEADS, HEAD_DIM), ("k_proj", "bias"): (KV_HEADS, HEAD_DIM),
    ("v_proj", "kernel"): (EMBED, KV_HEADS, HEAD_DIM), ("v_proj", "bias"): (KV_HEADS, HEAD_DIM),
    ("o_proj", "kernel"): (HEADS, HEAD_DIM, EMBED),
    # Multi-head latent attention's low-rank projections: into a rank, and from it by head.
    ("q_a_proj", "kernel"): (EMBED, None), ("kv_a_proj_with_mqa", "kernel"): (EMBED, None),
    ("q_b_proj", "kernel"): (None, HEADS, HEAD_DIM),
    ("kv_b_proj", "kernel"): (None, HEADS, HEAD_DIM),
    ("gate_proj", "kernel"): (EMBED, MLP), ("up_proj", "kernel"): (EMBED, MLP),
    ("down_proj", "kernel"): (MLP, EMBED),
    # A mixture's router and its experts stacked [E, in, out].
    ("gate", "kernel"): (EMBED, None), ("shared_expert_gate", "kernel"): (EMBED, None),
    ("mlp", "experts_gate_proj"): (EXPERTS, EMBED, MLP),
    ("mlp", "experts_up_proj"): (EXPERTS, EMBED, MLP),
    ("mlp", "experts_down_proj"): (EXPERTS, MLP, EMBED),
    ("mlp", "e_score_correction_bias"): (None,),  # DeepSeek-V3's, [E]
}


def param_logical_axes(params):
  """The logical axes of every parameter (a pytree of tuples shaped like `params`)."""

  def axes(path, leaf):
    keys = tuple(getattr(k, "key", str(k)) for k in path)
    if keys[-1] == "lm_head":
      return (EMBED, VOCAB)
    if keys[-1] == "scale":  # RMSNorm weights: small, replicated
      return (None,)
    try:
      return _PARAM_AXES[keys[-2:]]
    except KeyError:
      raise ValueError(f"no logical axes for parameter {'/'.join(keys)}") from None

  return jax.tree_util.tree_map_with_path(axes, params)


def param_shardings(params, mesh: Mesh):
  """NamedSharding for every parameter (params may be arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda axes, p: NamedSharding(mesh, spec(axes, p.shape, mesh)),
                      param_logical_axes(params), params,
                      is_leaf=lambda x: isinstance(x, tuple))


def serving_mesh(mesh: Mesh) -> Mesh:
  """`mesh`'s devices for decoding: its context and expert axes (a training-time sequence
  and expert split) folded into data, as more replicas that decode rows of their own."""
  if mesh.shape.get("context", 1) == mesh.shape.get("expert", 1) == 1:
    return mesh
  # data, expert, context, fsdp, tensor
  devices = np.moveaxis(mesh.devices, (AXES.index("expert"), AXES.index("context")), (1, 2))
  replicas = mesh.shape["data"] * mesh.shape["expert"] * mesh.shape["context"]
  shape = (replicas, mesh.shape["fsdp"], 1, mesh.shape["tensor"], 1)
  return Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def serving_shardings(params, mesh: Mesh):
  """NamedSharding for every parameter of an engine that decodes on `mesh` (a serving_mesh):
  split over `tensor` as in training, whole on each data / fsdp replica, which decodes rows
  of its own (gathering fsdp shards at every decode step would move all the weights per
  token)."""
  def whole_over_fsdp(placed):
    drop = lambda entry: (tuple(a for a in entry if a != "fsdp") or None
                          if isinstance(entry, tuple) else None if entry == "fsdp" else entry)
    return NamedSharding(mesh, P(*(drop(entry) for entry in placed.spec)))
  return jax.tree.map(whole_over_fsdp, param_shardings(params, mesh))


def state_shardings(state, optimizer: optax.GradientTransformation, mesh: Mesh):
  """Shardings for a TrainState: params by the rules, optimizer moments like their params,
  everything else (counts, the step) replicated."""
  params = param_shardings(state.params, mesh)
  replicated = NamedSharding(mesh, P())
  opt = optax.tree_map_params(optimizer, lambda _, s: s, state.opt_state, params,
                              transform_non_params=lambda _: replicated)
  return state.replace(params=params, opt_state=opt, step=replicated)


def check_sharded(params, mesh: Mesh, *, min_elements: int = 1 << 16):
  """Raise if a parameter with at least `min_elements` elements would sit whole on every
  device of a mesh whose fsdp x tensor size is larger than 1."""
  if mesh.shape.get("fsdp", 1) * mesh.shape.get("tensor", 1) == 1:
    return
  whole = [f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}"
           for (path, leaf), placed in zip(jax.tree_util.tree_leaves_with_path(params),
                                           jax.tree.leaves(param_shardings(params, mesh)))
           if math.prod(leaf.shape) >= min_elements and all(a is None for a in placed.spec)]
  if whole:
    raise MeshUnavailable(f"mesh {dict(mesh.shape)} leaves large weights unsharded (no dimension "
                          f"divisible by its fsdp/tensor axes): {whole[:5]}")


def in_memory(tree, kind: str):
  """`tree` with every jax.Array moved to memory `kind` of its own devices, layout kept:
  'pinned_host' (host memory the accelerator reads by DMA: a hybrid deployment keeps the
  train state there while the engine generates) or 'device'. The arrays given are deleted,
  as a donation would (which JAX does not do across memory kinds): their memory is freed at
  once, not when the last reference to them goes."""
  def move(x):
    if not isinstance(x, jax.Array) or x.sharding.memory_kind == kind:
      return x
    return jax.device_put(x, x.sharding.with_memory_kind(kind))
  moved = jax.block_until_ready(jax.tree.map(move, tree))
  for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(moved)):
    if old is not new:
      old.delete()
  return moved
