"""Model configuration: one frozen dataclass per architecture, plus small presets.

Owns the numbers that define a network's shape. It does not own training settings
(rl/) or sharding (models/sharding.py, later).
"""

import dataclasses

import jax.numpy as jnp

from models.attention.dispatch import KERNELS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer in the Qwen2 style.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True  # Qwen2/2.5 put a bias on q, k, v; Qwen3 and Llama do not.
  tie_embeddings: bool = True
  dtype: str = "float32"  # compute dtype; parameters are kept in float32.
  attention: str = "auto"  # kernel, see models/attention/dispatch.py

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE).")
    jnp.dtype(self.dtype)  # raises on an unknown dtype name
    if self.attention not in KERNELS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; choose one of {KERNELS}")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def tiny(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 2,
         num_heads: int = 4, num_kv_heads: int = 2,
         intermediate_size: int = 384, attention: str = "auto") -> ModelConfig:
  """A model small enough to train on a 2-core CPU in minutes."""
  return ModelConfig(
      vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=hidden_size // num_heads, intermediate_size=intermediate_size,
      attention=attention)
