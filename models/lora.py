"""LoRA: low-rank adapters over a frozen base (Hu et al., 2021), computed as SGLang 0.5.23 and
PEFT compute them: y = x W + (alpha / r) (x A) B, A initialised as PEFT's default
(kaiming-uniform, |A| <= 1 / sqrt(fan_in)) and B at zero, so that a fresh adapter leaves the
base's outputs as they are. SGLang scales by alpha / r and ignores rsLoRA (sglang
srt/lora/lora.py, `scaling = lora_alpha / r`), so this does too.

Owns `LoraConfig` (rank, alpha, which projections), the adapter tree (`init_adapters`: an
`Adapter` for each adapted kernel, at that kernel's path in the params), and the three ways a
model's params and adapters meet:
- `attach`: the params with each adapted kernel an `Adapted` (its base kernel and its adapter).
  models/projections.py computes a projection on one as the base's product plus the
  low-rank one, without forming W + scale A B; models/mixture.py merges a sparse layer's
  experts inside the layer (its three grouped-product paths take plain weights).
- `merge`: plain params, each adapted kernel W + scale A B: what an engine that takes plain
  weights holds, and a merged export.
- `base_of`: the params without their adapters: the frozen base, which is also a LoRA run's
  reference policy (no second copy of the model).

K arms' adapters (rl/arms.py: experiments over one base) stacked on a leading axis attach
with the arm of each row of a batch (`attach(..., arm=)`): a projection then adds to the
base's product, on each row, its own arm's low-rank one, so one batch decodes every arm.

Which projections: every decoder projection by default (q/k/v/o, gate/up/down, MLA's, a
mixture's shared experts and its routed experts), as "LoRA Without Regret" (Thinking Machines,
2025) found RL needs: attention-only adapters underperform. A name covers every kernel of that
name, as PEFT's `target_modules` does: "gate_proj" adapts the dense MLPs', the shared experts'
and each routed expert's gate projection. Routed experts get one adapter each, of rank
max(1, rank // num_experts) (and alpha / that rank), the rule of Thinking Machines and SkyRL's
JAX backend (skyrl/tx/layers/lora.py, `init_lora_adapter`): a mixture's adapter then holds
about as many parameters as a dense layer's. Routers, norms, embeddings, the output head and
a vision tower are not adapted.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models import quantize
from models.config import ModelConfig

# Every kernel LoRA can adapt, by the name PEFT's target_modules would give it.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
               "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj")
_EXPERTS = "experts_"  # a mixture's stacked expert kernels: experts_gate_proj, ...


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r and alpha (the scale is alpha / r); `targets`: the projections adapted, by name
  (PROJECTIONS; default all of them)."""
  rank: int = 32
  alpha: float = 32.0
  targets: tuple[str, ...] = PROJECTIONS

  @property
  def attention_only(self) -> bool:
    """Whether no MLP projection (dense, shared or routed expert) is adapted: what "LoRA
    Without Regret" found underperforms in RL."""
    return not set(self.targets) & {"gate_proj", "up_proj", "down_proj"}

  def check(self) -> None:
    """ValueError for a config that cannot adapt anything (init_adapters calls it)."""
    if self.rank < 1:
      raise ValueError(f"LoraConfig.rank: {self.rank}; a rank is at least 1")
    if self.alpha <= 0:
      raise ValueError(f"LoraConfig.alpha: {self.alpha}; it must be positive")
    unknown = sorted(set(self.targets) - set(PROJECTIONS))
    if unknown or not self.targets:
      raise ValueError(f"LoraConfig.targets: {unknown or 'none'} are not projections LoRA "
                       f"adapts; choose among {', '.join(PROJECTIONS)}")


@struct.dataclass
class Adapter:
  """One kernel's adapter: a [*inputs, r] and b [r, *outputs] for a projection's kernel
  [*inputs, *outputs]; a [E, in, r] and b [E, r, out] for E experts' kernels [E, in, out]."""
  a: jax.Array
  b: jax.Array
  scale: float = struct.field(pytree_node=False)  # alpha / r
  experts: bool = struct.field(pytree_node=False, default=False)

  def delta(self):
    """scale * a b, the kernel's shape, in float32."""
    a, b = self.a.astype(jnp.float32), self.b.astype(jnp.float32)
    if self.experts:
      return self.scale * jnp.einsum("eir,ero->eio", a, b)
    return self.scale * jnp.tensordot(a, b, axes=1)


@struct.dataclass
class Adapted:
  """A base kernel with its adapter. The kernel is the first leaf: flax checks a stored
  param's shape against its first leaf (flax.core.Scope.param), which is then the kernel's.
  arm: i32[rows], the arm of each row of the batch, when `adapter` holds K arms' adapters
  stacked (a [K, ...] and b [K, ...]); else None."""
  kernel: Any
  adapter: Adapter
  arm: Any = None


def _kernels(params):
  """(path of key strings, array, its input dims: quantize.projection_inputs, or None for a
  mixture's experts) of every kernel LoRA could adapt in `params`."""
  is_packed = lambda x: isinstance(x, quantize.Packed)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_packed)[0]:
    keys = tuple(k.key for k in path)
    inputs = quantize.projection_inputs(keys)
    if inputs is not None or (keys[0].startswith("layers_") and keys[-1].startswith(_EXPERTS)):
      yield keys, leaf, inputs


def _target(keys) -> str:
  return keys[-1][len(_EXPERTS):] if keys[-1].startswith(_EXPERTS) else keys[-2]


def _set(tree: dict, keys, value) -> None:
  for key in keys[:-1]:
    tree = tree.setdefault(key, {})
  tree[keys[-1]] = value


def init_adapters(params, lora: LoraConfig, cfg: ModelConfig, key: jax.Array) -> dict:
  """Fresh adapters (float32) for the kernels of `params` that `lora` targets: a nested dict
  with an Adapter at each adapted kernel's path. ValueError for a bad config, or one that
  targets no kernel of the model."""
  lora.check()
  adapters: dict = {}
  kernels = [kernel for kernel in _kernels(params) if _target(kernel[0]) in lora.targets]
  if not kernels:
    raise ValueError(f"LoRA: the model has no kernel among the targets {lora.targets}")
  for (keys, kernel, inputs), k in zip(kernels, jax.random.split(key, len(kernels))):
    shape = kernel.shape  # a quantize.Packed keeps its kernel's shape too
    if inputs is None:  # a mixture's experts [E, in, out]
      rank = max(1, lora.rank // cfg.moe.num_experts)
      experts, fan_in, fan_out = shape
      a_shape, b_shape = (experts, fan_in, rank), (experts, rank, fan_out)
    else:
      rank, fan_in = lora.rank, math.prod(shape[:inputs])
      a_shape, b_shape = (*shape[:inputs], rank), (rank, *shape[inputs:])
    bound = 1.0 / math.sqrt(fan_in)
    _set(adapters, keys, Adapter(
        jax.random.uniform(k, a_shape, jnp.float32, -bound, bound),
        jnp.zeros(b_shape, jnp.float32), lora.alpha / rank, inputs is None))
  return adapters


def attach(params, adapters, arm=None):
  """`params` with each kernel that `adapters` holds an Adapter for an Adapted (no copy).
  With `arm` (i32[rows]), `adapters` are K arms' stacked (rl/arms.py) and each row of a
  batch is computed with its arm's."""
  def join(base, adapter):
    if isinstance(adapter, Adapter):
      return Adapted(base, adapter, arm)
    missing = sorted(set(adapter) - set(base))
    if missing:
      raise ValueError(f"LoRA: adapters for {missing}, which the params do not have")
    return {k: join(v, adapter[k]) if k in adapter else v for k, v in base.items()}
  return join(params, adapters)


def _is_adapted(x) -> bool:
  return isinstance(x, Adapted)


def base_of(params):
  """params without their adapters: each Adapted its base kernel."""
  return jax.tree.map(lambda x: x.kernel if isinstance(x, Adapted) else x, params,
                      is_leaf=_is_adapted)


def merged_kernel(x: Adapted):
  """W + scale a b in W's dtype (a quantized base dequantized first)."""
  if x.arm is not None:
    raise ValueError("LoRA: K arms' adapters are not merged into one kernel; a mixture's "
                     "routed experts (merged in their layer) decode one arm at a time")
  kernel = quantize.unpack(x.kernel) if isinstance(x.kernel, quantize.Packed) else x.kernel
  return (kernel.astype(jnp.float32) + x.adapter.delta()).astype(kernel.dtype)


def merge(params):
  """Plain params: each Adapted kernel merged (merged_kernel)."""
  return jax.tree.map(lambda x: merged_kernel(x) if isinstance(x, Adapted) else x, params,
                      is_leaf=_is_adapted)


# One program per model: merged op by op, every sync would dispatch a few ops per kernel.
@jax.jit
def merged(base, adapters):
  """Plain params of `base` with `adapters` merged (fresh arrays): what an engine serves."""
  return merge(attach(base, adapters))


def weight(param):
  """A stored param as the array to compute with: an Adapted one merged."""
  return merged_kernel(param) if isinstance(param, Adapted) else param


def low_rank(lhs, adapter: Adapter, dimension_numbers, dtype, arm=None):
  """scale (lhs a) b for the projection lhs . kernel with `dimension_numbers` (the kernel's
  contracted dims its leading ones, as a's): [..., *outputs] in `dtype`. With `arm`
  (i32[rows]; lhs's leading axis its rows, or rows x seq tokens, models/projections.on_tokens),
  `adapter` holds K arms' (a [K, *inputs, r], b [K, r, *outputs]) and each row gets its arm's."""
  (lhs_contracted, rhs_contracted), _ = dimension_numbers
  a, b = adapter.a.astype(dtype), adapter.b.astype(dtype)
  if arm is not None:
    # The K adapters as one of rank K r, each row's h kept on its arm's r columns only: one
    # product for every arm (K r is small), where gathering each token's own a would copy
    # it per token.
    arms, rank = a.shape[0], a.shape[-1]
    a = jnp.moveaxis(a, 0, -2).reshape(*a.shape[1:-1], arms * rank)
    b = b.reshape(arms * rank, *b.shape[2:])
  h = jax.lax.dot_general(lhs, a, ((lhs_contracted, rhs_contracted), ((), ())))
  if arm is not None:
    if h.shape[0] % arm.shape[0]:
      raise ValueError(f"LoRA arms: {arm.shape[0]} rows' arms for a projection of "
                       f"{h.shape[0]} leading rows or tokens")
    token_arm = jnp.repeat(arm, h.shape[0] // arm.shape[0])
    keep = jnp.repeat(jax.nn.one_hot(token_arm, arms, dtype=dtype), rank, axis=-1)
    h = h * keep.reshape(h.shape[0], *[1] * (h.ndim - 2), arms * rank)
  out = jax.lax.dot_general(h, b, (((h.ndim - 1,), (0,)), ((), ())))
  return out * jnp.asarray(adapter.scale, dtype)


def count(adapters) -> int:
  """The adapters' parameters."""
  return sum(x.size for x in jax.tree.leaves(adapters))
