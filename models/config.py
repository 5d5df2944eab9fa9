"""Model configuration: one frozen dataclass for the supported decoder families, plus presets.

Owns the numbers that define a network's shape and how it computes (dtypes, attention kernel,
rematerialisation). It does not own training settings (rl/), sharding (models/sharding.py) or
the Hugging Face config.json format (models/hf.py reads and writes it).

Families: "qwen2" (Qwen2 / Qwen2.5: bias on q, k, v), "qwen3" (RMSNorm on each head's q and k,
no bias, head_dim independent of the width), "llama" (Llama 3.x: no bias), "qwen2_moe" and
"qwen3_moe" (Qwen2's and Qwen3's attention, sparse layers of experts: `MoeConfig`; Qwen2-MoE's
with a gated shared expert), "deepseek_v3" (DeepSeek-V3, Kimi K2,
Moonlight: multi-head latent attention, `MlaConfig`, and DeepSeek's router and shared experts),
"qwen2_5_vl" (Qwen2.5-VL: Qwen2's decoder with multimodal RoPE, `mrope_section`, behind a
vision tower, `VisionConfig`; models/vision.py).
Everything else (RMSNorm, RoPE, grouped-query attention, SwiGLU) is shared, and so are the RoPE
scalings (`RopeScaling`: linear, dynamic, yarn, llama3), any of which a family's checkpoint may
name; models/rope.py computes their frequencies.
"""

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from models.attention.dispatch import KERNELS

WEIGHT_FORMATS = ("fp8", "int4")  # models/quantize.py's


FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen2_5_vl")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")
# Per-layer rematerialisation (gradient checkpointing) policies, by name.
REMAT_POLICIES = ("none", "full", "dots")


# RoPE frequency scalings: one frozen dataclass per Hugging Face rope_type (its `rope_type`
# class attribute), holding the parameters that type's rule in transformers'
# modeling_rope_utils reads.

@dataclasses.dataclass(frozen=True)
class LinearRope:
  """Position interpolation (rope_type "linear"): every frequency divided by `factor`."""
  rope_type: ClassVar[str] = "linear"
  factor: float


@dataclasses.dataclass(frozen=True)
class DynamicRope:
  """Dynamic NTK scaling (rope_type "dynamic"): for sequences of n > max_position_embeddings
  tokens, theta times a^(head_dim / (head_dim - 2)) with
  a = factor x n / max_position_embeddings - (factor - 1), which slows the lowest frequency by a.

  Here n is fixed at factor x max_position_embeddings (a = factor^2 - factor + 1) for every
  sequence, as SGLang and vLLM compute it. transformers instead takes n from the longest
  position of each batch (plain RoPE up to max_position_embeddings), so the two agree on a
  sequence of exactly that length and differ on shorter ones. One fixed table keeps the
  trainer, the KV-cache decoder and an SGLang engine on the same encoding, whatever the row
  or cache length.
  """
  rope_type: ClassVar[str] = "dynamic"
  factor: float
  max_position_embeddings: int  # the checkpoint's trained context (config.json top level)


@dataclasses.dataclass(frozen=True)
class YarnRope:
  """YaRN (rope_type "yarn"; Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts" interpolation
  plus an attention temperature): dimensions that turn fewer than `beta_slow` times within the
  original context are interpolated (frequency / factor), those turning more than `beta_fast`
  times are kept, a linear ramp over the dimensions between; cos and sin are multiplied by
  `attention_factor`, so the q.k logits by its square.
  """
  rope_type: ClassVar[str] = "yarn"
  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True  # round the ramp's ends to whole dimensions
  attention_factor: float | None = None  # None: the paper's 0.1 ln(factor) + 1
  # DeepSeek's: multi-head latent attention (MlaConfig) multiplies its softmax scale by
  # (0.1 mscale_all_dim ln(factor) + 1)^2, the nope dims' logits too; other families ignore it.
  mscale_all_dim: float | None = None

  def softmax_scale(self) -> float:
    """The factor MLA's q.k logits take beside 1/sqrt(head_dim) (transformers'
    yarn_apply_mscale)."""
    if not self.mscale_all_dim or self.factor <= 1:
      return 1.0
    return (0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0) ** 2


@dataclasses.dataclass(frozen=True)
class Llama3Rope:
  """Llama 3's scaling (rope_type "llama3"): wavelengths beyond original / low_freq_factor
  slowed by `factor`, those below original / high_freq_factor kept, the band between
  interpolated."""
  rope_type: ClassVar[str] = "llama3"
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


RopeScaling = LinearRope | DynamicRope | YarnRope | Llama3Rope
ROPE_SCALINGS = {cls.rope_type: cls for cls in (LinearRope, DynamicRope, YarnRope, Llama3Rope)}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The sparse layers of a mixture of experts (Qwen3-MoE's spelling in config.json:
  num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
  decoder_sparse_step, mlp_only_layers). Layer l is sparse when l is not in `dense_layers`
  and (l + 1) % sparse_step == 0; the others are the dense MLP of intermediate_size.

  DeepSeek-V3's router (n_group, topk_group, routed_scaling_factor, n_shared_experts,
  first_k_dense_replace in its config.json): `scoring` "sigmoid" scores each expert on its
  own; with a `correction_bias` (e_score_correction_bias, which loss-free balancing moves)
  added to the scores for choosing only; the experts in `groups` groups of which the
  `top_groups` best (each by its two best scores) are eligible; the k weights, renormalised
  or not, times `scaling`; and beside the routed experts a shared SwiGLU of width
  `shared_size` that every token goes through (Qwen2-MoE's shared_expert_intermediate_size:
  with `shared_gate`, its output times the sigmoid of a learned gate of the token).

  capacity_factor: None runs every (token, expert) pair (dropless); a factor f gives each
  expert room for ceil(f * T * k / E) of a forward pass's T tokens' pairs and drops the rest
  (GShard's capacity; padding tokens take room too), for backends without grouped matrix
  products (XLA:CPU: bench/moe.py)."""
  num_experts: int
  experts_per_token: int
  expert_size: int  # each expert's SwiGLU width
  normalize_weights: bool = False  # the k routing weights renormalised to sum to 1
  sparse_step: int = 1
  dense_layers: tuple[int, ...] = ()
  scoring: str = "softmax"  # or "sigmoid"
  correction_bias: bool = False
  groups: int = 1
  top_groups: int = 1
  scaling: float = 1.0
  shared_size: int = 0
  shared_gate: bool = False
  capacity_factor: float | None = None

  def capacity(self, tokens: int) -> int:
    """Pairs an expert has room for in a forward pass over `tokens` tokens."""
    return math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.num_experts)

  def __post_init__(self):
    if not 0 < self.experts_per_token <= self.num_experts:
      raise ValueError(f"MoeConfig: experts_per_token={self.experts_per_token} must be in "
                       f"[1, num_experts={self.num_experts}]")
    if self.scoring not in ("softmax", "sigmoid"):
      raise ValueError(f"MoeConfig.scoring={self.scoring!r}; choose 'softmax' or 'sigmoid'")
    if self.num_experts % self.groups or not 0 < self.top_groups <= self.groups:
      raise ValueError(f"MoeConfig: groups={self.groups} must divide num_experts="
                       f"{self.num_experts}, and top_groups={self.top_groups} be in [1, groups]")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      raise ValueError(f"MoeConfig.capacity_factor={self.capacity_factor} must be > 0 (None: "
                       "dropless)")
    if self.shared_gate and not self.shared_size:
      raise ValueError("MoeConfig.shared_gate gates the shared expert: it needs shared_size")
    if self.experts_per_token > self.top_groups * (self.num_experts // self.groups):
      raise ValueError(f"MoeConfig: {self.top_groups} of {self.groups} groups hold fewer than "
                       f"experts_per_token={self.experts_per_token} experts")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """DeepSeek-V3's multi-head latent attention (config.json: q_lora_rank, kv_lora_rank,
  qk_rope_head_dim, v_head_dim, rope_interleave; qk_nope_head_dim is ModelConfig.head_dim -
  rope_dim). Queries come through a rank-`q_rank` bottleneck with its RMSNorm (None: one
  projection); keys and values from one latent of rank `kv_rank` per token (RMSNorm'd), which
  kv_b_proj expands into every head's key (its first head_dim - rope_dim dims, without
  position) and value (value_dim); the key's last rope_dim dims are one rotated vector per
  token shared by the heads, the query's its own. Attention runs on the expanded keys and on
  values zero-padded to head_dim, so every kernel and the KV cache serve it as they are.

  rope_interleave: the rotated dims pair up as (0, 1), (2, 3), ... (DeepSeek's checkpoints),
  not as the halves (i, i + rope_dim / 2) of every other family."""
  kv_rank: int
  rope_dim: int
  value_dim: int
  q_rank: int | None = None
  rope_interleave: bool = True


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Qwen2.5-VL's vision tower and the image tokens it feeds (config.json's vision_config and
  its image and vision_start/end token ids; the image bounds are preprocessor_config.json's).

  An image is resized to multiples of patch_size * spatial_merge_size pixels (its area kept in
  [min_pixels, max_pixels]), cut into patches of patch_size^2 pixels (each repeated over
  temporal_patch_size frames: a still image), and every spatial_merge_size^2 patches become
  one token of the decoder, `image_token_id`, width out_hidden_size. Blocks attend within
  windows of window_size pixels, but those in `full_attention_blocks`, which see the image.
  """
  depth: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  out_hidden_size: int  # the decoder's hidden_size
  image_token_id: int
  vision_start_token_id: int
  vision_end_token_id: int
  video_token_id: int  # read and written back; videos are not taken
  patch_size: int = 14
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  window_size: int = 112
  full_attention_blocks: tuple[int, ...] = (7, 15, 23, 31)
  rope_theta: float = 10000.0
  tokens_per_second: int = 4  # a video's; written back
  min_pixels: int = 56 * 56
  max_pixels: int = 28 * 28 * 16384  # the hub's Qwen2.5-VL preprocessor_config.json
  image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # CLIP's
  image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

  def __post_init__(self):
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
      raise ValueError(f"VisionConfig: hidden_size={self.hidden_size} over num_heads="
                       f"{self.num_heads} must give a head_dim divisible by 4 (its 2D RoPE "
                       "turns a quarter of the pairs by the row, a quarter by the column)")
    if self.window_size % (self.patch_size * self.spatial_merge_size):
      raise ValueError(f"VisionConfig.window_size={self.window_size} must be a multiple of "
                       f"patch_size * spatial_merge_size = "
                       f"{self.patch_size * self.spatial_merge_size} pixels")
    if not all(0 <= b < self.depth for b in self.full_attention_blocks):
      raise ValueError(f"VisionConfig.full_attention_blocks={self.full_attention_blocks} "
                       f"name blocks outside [0, depth={self.depth})")

  @property
  def patch_dim(self) -> int:
    """Values of one patch: 3 channels x temporal_patch_size x patch_size^2."""
    return 3 * self.temporal_patch_size * self.patch_size ** 2

  @property
  def merge(self) -> int:
    """Patches per decoder token."""
    return self.spatial_merge_size ** 2


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
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  attention: str = "auto"  # kernel, see models/attention/dispatch.py
  family: str = "qwen2"
  rope_scaling: RopeScaling | None = None
  remat: str = "none"  # per layer: none | full (save nothing) | dots (save matmul outputs)
  # The decoder layers' projections compute with their weights rounded to this format
  # (models/quantize.py: "fp8" or "int4", as a quantized checkpoint stores them), gradients
  # straight through: an engine on quantized weights, or quantization-aware training.
  weight_format: str | None = None
  moe: MoeConfig | None = None  # None: every layer dense
  # deepseek_v3's attention (its head_dim is qk_nope + qk_rope, num_kv_heads = num_heads)
  mla: MlaConfig | None = None
  # qwen2_5_vl: the image tower, and multimodal RoPE: the rotary frequency pairs in sections
  # turned by a token's temporal, height and width positions in turn (transformers'
  # mrope_section; positions i32[rows, seq, 3], or [rows, seq] for all three alike)
  vision: VisionConfig | None = None
  mrope_section: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE).")
    jnp.dtype(self.dtype)  # raises on an unknown dtype name
    jnp.dtype(self.param_dtype)
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r}; choose one of {FAMILIES}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}")
    if self.attention not in KERNELS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; choose one of {KERNELS}")
    if (self.family in MOE_FAMILIES) != (self.moe is not None):
      raise ValueError(f"ModelConfig: family {self.family!r} with moe={self.moe}: the "
                       f"mixture-of-experts families ({', '.join(MOE_FAMILIES)}), and they "
                       "alone, have a MoeConfig")
    if (self.family == "deepseek_v3") != (self.mla is not None):
      raise ValueError(f"ModelConfig: family {self.family!r} with mla={self.mla}: the "
                       "deepseek_v3 family, and it alone, has an MlaConfig")
    if self.mla is not None:
      self._check_mla()
    if (self.family == "qwen2_5_vl") != (self.vision is not None) or (
        (self.vision is None) != (self.mrope_section is None)):
      raise ValueError(f"ModelConfig: family {self.family!r} with vision={self.vision} and "
                       f"mrope_section={self.mrope_section}: the qwen2_5_vl family, and it "
                       "alone, has a VisionConfig and an mrope_section")
    if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
      raise ValueError(f"ModelConfig.mrope_section={self.mrope_section} must sum to "
                       f"head_dim / 2 = {self.head_dim // 2} rotary frequency pairs")
    if self.weight_format not in (None, *WEIGHT_FORMATS):
      raise ValueError(f"ModelConfig.weight_format={self.weight_format!r}; choose one of "
                       f"{WEIGHT_FORMATS} or None")

  def _check_mla(self):
    m = self.mla
    if self.num_kv_heads != self.num_heads:
      raise ValueError(f"ModelConfig: multi-head latent attention expands a key and a value "
                       f"for every head: num_kv_heads={self.num_kv_heads} must equal "
                       f"num_heads={self.num_heads}")
    if m.rope_dim % 2 or not 0 < m.rope_dim < self.head_dim:
      raise ValueError(f"MlaConfig.rope_dim={m.rope_dim} must be even and below head_dim="
                       f"{self.head_dim} (qk_nope_head_dim + qk_rope_head_dim)")
    if not 0 < m.value_dim <= self.head_dim:
      raise ValueError(f"MlaConfig.value_dim={m.value_dim} must be in [1, head_dim="
                       f"{self.head_dim}]: values are zero-padded to the keys' width")

  @property
  def rope_dim(self) -> int:
    """The dims of a query and a key that RoPE rotates (the last ones)."""
    return self.head_dim if self.mla is None else self.mla.rope_dim

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def qk_norm(self) -> bool:
    return self.family in ("qwen3", "qwen3_moe")

  def sparse(self, layer: int) -> bool:
    """Whether decoder layer `layer` is a mixture of experts (MoeConfig says which)."""
    m = self.moe
    return (m is not None and layer not in m.dense_layers
            and (layer + 1) % m.sparse_step == 0)

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    """The decoder layers that are mixtures of experts, in order (a Route's layer axis)."""
    return tuple(layer for layer in range(self.num_layers) if self.sparse(layer))


def tiny(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 2,
         num_heads: int = 4, num_kv_heads: int = 2,
         intermediate_size: int = 384, attention: str = "auto",
         remat: str = "none", weight_format: str | None = None,
         moe: MoeConfig | None = None, vision: VisionConfig | None = None,
         rope_theta: float = 10000.0) -> ModelConfig:
  """A model small enough to train on a 2-core CPU in minutes: a Qwen2, with `moe` a
  Qwen3-MoE (its sparse layers' experts as `moe` says), with `vision` a Qwen2.5-VL (that
  tower in front; the rotary pairs split 1 : 1.5 : 1.5 over time, height and width as the
  hub's [16, 24, 24])."""
  head_dim = hidden_size // num_heads
  section = None
  if vision is not None:
    vision = dataclasses.replace(vision, out_hidden_size=hidden_size)
    pairs = head_dim // 2
    section = (pairs - 2 * (3 * pairs // 8), 3 * pairs // 8, 3 * pairs // 8)
  family = "qwen2" if moe is None and vision is None else (
      "qwen3_moe" if vision is None else "qwen2_5_vl")
  return ModelConfig(
      vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, intermediate_size=intermediate_size,
      attention=attention, remat=remat, weight_format=weight_format, moe=moe,
      family=family, qkv_bias=moe is None, vision=vision, mrope_section=section,
      rope_theta=rope_theta)


def tiny_vision(out_hidden_size: int = 128, token_ids: tuple[int, int, int, int] = (4, 3, 5, 6),
                *, hidden_size: int = 64, depth: int = 2, num_heads: int = 2,
                intermediate_size: int = 128, max_pixels: int = 224 * 224) -> VisionConfig:
  """A vision tower small enough for a 2-core CPU: Qwen2.5-VL's patches (14 px, merged 2 x 2),
  windows of 56 px, the last block over the whole image; images of at most `max_pixels`.
  token_ids: (image, vision start, vision end, video), by default those of a CharTokenizer
  with models.tokenizer.VISION_SPECIALS. `tiny(vision=...)` sets out_hidden_size to its
  width."""
  image, start, end, video = token_ids
  return VisionConfig(depth=depth, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_heads=num_heads, out_hidden_size=out_hidden_size,
                      image_token_id=image, vision_start_token_id=start,
                      vision_end_token_id=end, video_token_id=video, window_size=56,
                      full_attention_blocks=(depth - 1,), max_pixels=max_pixels)
