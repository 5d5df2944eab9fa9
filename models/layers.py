"""The building blocks the decoder and the vision tower share: RMSNorm and SwiGLU."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
  eps: float
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return scale.astype(x.dtype) * x32.astype(x.dtype)  # Hugging Face's order of casts


@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up, elementwise; gate, up: [..., intermediate].

  Its backward pass keeps only `gate` and `up` (outputs of the projections) and recomputes the
  sigmoid in one pass. Differentiated through as written, it also stores the sigmoid (or
  silu) of every layer: 11% more temporary memory in the train step of bench/peers.py.
  """
  return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, d_out):
  gate, up = residuals
  sig = jax.nn.sigmoid(gate)
  # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
  return d_out * up * sig * (1 + gate * (1 - sig)), d_out * gate * sig


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
