"""Weight quantization in the layouts SGLang 0.5.23 loads (../shared/reference/formats.md, 3.2
and 3.4): FP8 with block scales and INT4 weight-only with group scales.

Owns the quantize, pack and dequantize arithmetic, on one Linear's weight in the checkpoint's
layout [out, in] (a flax kernel is its transpose), in jnp so that it runs under jit:

- FP8 (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, DeepSeek-V3's checkpoints):
  `weight` float8_e4m3fn [out, in] and `weight_scale_inv` f32 [ceil(out/128), ceil(in/128)],
  w = q * s blockwise (the scale multiplies despite its name; SGLang fp8_utils.py
  block_quant_dequant). Each block's scale is its largest |w| / 448, e4m3's largest value.
- INT4 (compressed-tensors `pack-quantized`, symmetric, `group_size` 32: Kimi K2 Thinking's):
  `weight_packed` int32 [out, in / 8], eight 4-bit values a word, value k of a row in word
  k // 8 at bits 4 (k % 8), each stored as q + 8 in [0, 15]; `weight_scale` [out, in / group]
  in the model's dtype; w = q * scale groupwise (compressed_tensors pack_to_int32, SGLang
  compressed_tensors_wNa16.py). Each group's scale is its largest |w| / 7.5, q = round(w /
  scale) clamped to [-8, 7].
- `Packed`: a projection's kernel held in a format (an engine's or a server's weights at rest:
  `pack` / `unpack`), its arrays exactly a checkpoint's tensors of that projection.
- `fake_quantize`: the round trip with straight-through gradients, so that a trainer's forward
  computes on the weights the engine holds (quantization-aware training).
- `projection_inputs`: which params are a decoder layer's projections (what a quantized
  checkpoint stores quantized, and what LoRA adapts) and how many input dims each contracts.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_BLOCK = (128, 128)
INT4_GROUP = 32
_INT4_LEVELS = 7.5  # compressed-tensors' symmetric scale: absmax / 7.5


def _blocks(n: int, size: int) -> int:
  return -(-n // size)


def fp8_quantize(w, block: tuple[int, int] = FP8_BLOCK):
  """w: [out, in] -> (q float8_e4m3fn [out, in], scale f32 [ceil(out/bo), ceil(in/bi)]).

  Edge blocks are zero-padded to the block size before their scale is taken."""
  out, inp = w.shape
  bo, bi = block
  rows, cols = _blocks(out, bo), _blocks(inp, bi)
  padded = jnp.pad(w.astype(jnp.float32), ((0, rows * bo - out), (0, cols * bi - inp)))
  tiles = padded.reshape(rows, bo, cols, bi)
  amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
  scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  q = (tiles / scale[:, None, :, None]).astype(jnp.float8_e4m3fn)
  return q.reshape(rows * bo, cols * bi)[:out, :inp], scale


def fp8_dequantize(q, scale, block: tuple[int, int] = FP8_BLOCK, dtype=jnp.float32):
  """(q [out, in], scale [ceil(out/bo), ceil(in/bi)]) -> w [out, in] in `dtype`."""
  out, inp = q.shape
  per_element = jnp.repeat(jnp.repeat(scale, block[0], axis=0), block[1], axis=1)[:out, :inp]
  return (q.astype(jnp.float32) * per_element).astype(dtype)


def pack_int4(q):
  """i32 values in [-8, 7], [rows, k] (k a multiple of 8) -> i32 [rows, k / 8]: value j of
  each eight in bits 4j of its word, stored as q + 8."""
  rows, k = q.shape
  nibbles = (q + 8).astype(jnp.uint32).reshape(rows, k // 8, 8)
  words = jnp.sum(nibbles << (4 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_int4(packed):
  """The inverse of `pack_int4`: i32 [rows, k / 8] -> i32 [rows, k] in [-8, 7]."""
  words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
  nibbles = (words[..., None] >> (4 * jnp.arange(8, dtype=jnp.uint32))) & 0xF
  return nibbles.reshape(packed.shape[0], -1).astype(jnp.int32) - 8


def int4_quantize(w, group: int = INT4_GROUP, scale_dtype=None):
  """w: [out, in] (in a multiple of `group` and of 8) -> (packed i32 [out, in / 8], scale
  [out, in / group] in `scale_dtype`, default w's: compressed-tensors stores the scales in the
  model's dtype). q is computed against the scale as stored, so that dequantizing the stored
  pair gives what this rounding chose."""
  out, inp = w.shape
  if inp % group or inp % 8:
    raise ValueError(f"int4_quantize: the input dimension {inp} must be a multiple of the "
                     f"group size {group} and of 8")
  groups = w.astype(jnp.float32).reshape(out, inp // group, group)
  amax = jnp.max(jnp.abs(groups), axis=-1)
  scale = jnp.where(amax > 0, amax / _INT4_LEVELS, 1.0).astype(scale_dtype or w.dtype)
  q = jnp.clip(jnp.round(groups / scale.astype(jnp.float32)[..., None]), -8, 7)
  return pack_int4(q.reshape(out, inp).astype(jnp.int32)), scale


def int4_dequantize(packed, scale, group: int = INT4_GROUP, dtype=jnp.float32):
  """(packed i32 [out, in / 8], scale [out, in / group]) -> w [out, in] in `dtype`."""
  q = unpack_int4(packed).astype(jnp.float32)
  return (q * jnp.repeat(scale.astype(jnp.float32), group, axis=1)).astype(dtype)


FORMATS = {"fp8": (fp8_quantize, fp8_dequantize), "int4": (int4_quantize, int4_dequantize)}


def _check_format(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {sorted(FORMATS)}")


def _rounded(w, fmt: str):
  """w [out, in] quantized to `fmt` and back, in w's dtype."""
  quantize, dequantize = FORMATS[fmt]
  return dequantize(*quantize(w), dtype=w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quantize(w, fmt: str):
  """w [out, in] as the engine holds it in format `fmt` ("fp8" or "int4"), in w's dtype, with
  the identity's gradient (straight through): the forward sees the rounding, the update
  reaches the full-precision weights."""
  _check_format(fmt)
  return _rounded(w, fmt)


def _fake_quantize_fwd(w, fmt):
  return fake_quantize(w, fmt), None


fake_quantize.defvjp(_fake_quantize_fwd, lambda fmt, _, g: (g,))


@struct.dataclass
class Packed:
  """A projection's kernel held in weight format `fmt`: `stored`, the format's arrays of its
  [out, in] matrix (fp8: q, scale; int4: packed, scale), what a checkpoint stores for it;
  `shape` and `dtype` the kernel's, whose first `contracted` dims are its inputs."""
  stored: tuple
  fmt: str = struct.field(pytree_node=False)
  shape: tuple = struct.field(pytree_node=False)
  contracted: int = struct.field(pytree_node=False)
  dtype: str = struct.field(pytree_node=False)


def projection_inputs(path) -> int | None:
  """How many leading (input) dims the kernel at params `path` (its keys) contracts, when it
  is a decoder layer's projection (what a quantized checkpoint stores quantized), else None."""
  if not (path[0].startswith("layers_") and path[-1] == "kernel"
          and path[-2].endswith(("_proj", "_proj_with_mqa"))):
    return None
  return 2 if path[-2] == "o_proj" else 1  # o_proj's kernel is [heads, head_dim, hidden]


def kernel_matrix(kernel, contracted: int):
  """A flax kernel (its `contracted` input dims first) as the checkpoint's [out, in] matrix."""
  return kernel.reshape(math.prod(kernel.shape[:contracted]), -1).T


def pack(kernel, fmt: str, contracted: int = 1) -> Packed:
  """`kernel` quantized to `fmt` (its matrix as `kernel_matrix` gives it)."""
  _check_format(fmt)
  return Packed(tuple(FORMATS[fmt][0](kernel_matrix(kernel, contracted))), fmt,
                tuple(kernel.shape), contracted, jnp.dtype(kernel.dtype).name)


def unpack(p: Packed):
  """The kernel `p` holds, dequantized: what `fake_quantize` computes on, exactly."""
  matrix = FORMATS[p.fmt][1](*p.stored, dtype=jnp.dtype(p.dtype))
  return matrix.T.reshape(p.shape)
