"""The decoder's projections: flax Dense layers that compute on their kernels rounded to
`ModelConfig.weight_format` (quantization-aware training, models/quantize.py's formats, with
straight-through gradients) and on a LoRA kernel as its base plus its adapter
(models/lora.py), holding them packed in a format and dequantizing them on the fly, and the
SwiGLU MLP built from them (a dense layer's, and a mixture's shared experts).
"""

import functools

import flax.linen as nn
import jax
from flax.linen.dtypes import promote_dtype

from models import lora, quantize
from models import sharding as shd
from models.config import ModelConfig
from models.layers import swiglu


def on_tokens(layer, x):
  """layer(x) with x's rows and sequence [rows, seq, ...] merged into one axis of tokens.

  A projection's weight gradient contracts over every token; given rows and sequence as two
  contracting axes, XLA:CPU lays its operands out transposed first, and those strided copies
  took ~40% of the MLP's backward pass (bench/peers.py).
  """
  rows, seq = x.shape[:2]
  y = layer(x.reshape(rows * seq, *x.shape[2:]))
  return y.reshape(rows, seq, *y.shape[1:])


@functools.cache
def _dot(fmt: str | None):
  """A dot_general for flax's Dense / DenseGeneral: with weight format `fmt`, the kernel (its
  right operand, input dims first) rounded to it as the checkpoint's [out, in] matrix
  (models/quantize.py), with straight-through gradients; on a LoRA kernel (models/lora.py:
  the base rounded, the adapter not), the base's product plus the adapter's low-rank one."""
  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    adapted = isinstance(rhs, lora.Adapted)
    kernel = rhs.kernel if adapted else rhs
    if fmt is not None:
      (_, contracted), _ = dimension_numbers
      if tuple(contracted) != tuple(range(len(contracted))):
        raise ValueError(f"weight_format: a kernel contracted over dims {contracted}, not its "
                         "leading ones")
      matrix = quantize.kernel_matrix(kernel, len(contracted))
      kernel = quantize.fake_quantize(matrix, fmt).T.reshape(kernel.shape)
    y = jax.lax.dot_general(lhs, kernel, dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type)
    if adapted:
      y = y + lora.low_rank(lhs, rhs.adapter, dimension_numbers, y.dtype, rhs.arm)
    return y
  return dot_general


def _promote_dtype(inputs, kernel, bias, dtype=None):
  """flax's promote_dtype, for a plain or a LoRA kernel (whose adapter the dot casts)."""
  if not isinstance(kernel, lora.Adapted):
    return promote_dtype(inputs, kernel, bias, dtype=dtype)
  inputs, base, bias = promote_dtype(inputs, kernel.kernel, bias, dtype=dtype)
  return inputs, kernel.replace(kernel=base), bias


def pack_projections(params, fmt: str):
  """`params` with every decoder layer's projection kernel held in weight format `fmt`
  (quantize.Packed): an engine's weights at rest, as a quantized checkpoint stores them."""
  def maybe_pack(path, x):
    inputs = quantize.projection_inputs(tuple(k.key for k in path))
    return x if inputs is None else quantize.pack(x, fmt, inputs)
  return jax.tree_util.tree_map_with_path(maybe_pack, params)


def unpack_projections(params):
  """`params` with every quantize.Packed kernel dequantized (the others as they are)."""
  is_packed = lambda x: isinstance(x, quantize.Packed)
  return jax.tree.map(lambda x: quantize.unpack(x) if is_packed(x) else x, params,
                      is_leaf=is_packed)


def projection(cfg: ModelConfig, module, *args, **kwargs):
  """`module(*args, **kwargs)` (nn.Dense or nn.DenseGeneral), computing on its weights rounded
  to cfg.weight_format when it has one, and on a LoRA kernel as its base and adapter."""
  return module(*args, dot_general=_dot(cfg.weight_format), promote_dtype=_promote_dtype,
                **kwargs)



class MLP(nn.Module):
  """The SwiGLU MLP, of width `size` (default cfg.intermediate_size)."""
  cfg: ModelConfig
  size: int | None = None

  @nn.compact
  def __call__(self, x):
    dense = lambda size, name: projection(
        self.cfg, nn.Dense, size, use_bias=False, dtype=self.cfg.compute_dtype,
        param_dtype=self.cfg.param_dtype, name=name)
    size = self.size or self.cfg.intermediate_size
    hidden = swiglu(on_tokens(dense(size, "gate_proj"), x),
                    on_tokens(dense(size, "up_proj"), x))
    hidden = shd.constrain(hidden, shd.BATCH, shd.SEQ, shd.ACT_MLP)
    return on_tokens(dense(self.cfg.hidden_size, "down_proj"), hidden)
