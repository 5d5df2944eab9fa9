"""Hugging Face checkpoints: config.json and safetensors, in and out.

Owns the mapping between a Hugging Face checkpoint directory (config.json, one or many
*.safetensors files with model.safetensors.index.json) and our (ModelConfig, params). Import
streams tensor by tensor (one tensor in host memory at a time, each placed on its devices, with
its sharding when given, before the next is read); export writes the layout Hugging Face
writes (sharded files plus the index), which transformers and an SGLang server load
(/update_weights_from_disk). No network access anywhere.

Weights: HF stores a linear layer as weight[out, in]; ours are kernel[in, out], with the
attention projections split by head: q_proj kernel[hidden, heads, head_dim], o_proj
kernel[heads, head_dim, hidden]. RMSNorm `weight` is our `scale`.

config.json's RoPE scaling (`rope_scaling`, transformers 4's spelling, which replaces 5's
`rope_parameters` when both are there) becomes `ModelConfig.rope_scaling`: linear, dynamic,
yarn or llama3, with transformers' defaults filled in; any other rope type is a CheckpointError.

Quantized weights (`save(..., quantization=...)`, models/quantize.py): every projection of the
decoder layers (q, k, v, o, gate, up, down) in FP8 with 128 x 128 block scales (`"fp8"`,
DeepSeek-V3's layout) or INT4 with scales per group of 32 inputs (`"int4"`,
compressed-tensors' pack-quantized, Kimi K2 Thinking's), with the `quantization_config`
SGLang selects its loader by (../shared/reference/formats.md, 3.2 and 3.4); embeddings, norms
and lm_head stay in the checkpoint's dtype. `load` reads both back, dequantized.
"""

import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import struct
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models import quantize, transformer
from models.config import (ROPE_SCALINGS, DynamicRope, Llama3Rope, LinearRope, MlaConfig,
                           ModelConfig, MoeConfig, RopeScaling, VisionConfig, YarnRope)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "llama": "LlamaForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM",
                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
# Params kept in float32 whatever the checkpoint's dtype: DeepSeek-V3's correction bias, which
# sets the choice of experts by differences a few bf16 ulps wide (SGLang keeps it float32:
# models/deepseek_v2.py MoEGate).
_FLOAT32 = ("e_score_correction_bias",)
# Files a checkpoint directory carries besides weights and config (copied by `save`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.json",
                   "chat_template.jinja")
PREPROCESSOR = "preprocessor_config.json"  # a vision model's image processor
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as the model it claims to be."""


# config.json's quantization_config of each weight format `save` writes.
QUANTIZATIONS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(quantize.FP8_BLOCK)},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "quantization_status": "compressed", "ignore": ["lm_head"],
             "config_groups": {"group_0": {
                 "targets": ["Linear"], "input_activations": None,
                 "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                             "group_size": quantize.INT4_GROUP, "symmetric": True,
                             "dynamic": False, "actorder": None}}}},
}


# ---- config.json ----

def config_from_hf(hf: dict[str, Any], preprocessor: dict[str, Any] | None = None,
                   **overrides) -> ModelConfig:
  """ModelConfig from a parsed config.json (transformers 4.x and 5.x spellings), and for a
  vision-language model its preprocessor_config.json's image bounds.

  `overrides` set fields config.json does not hold (dtype, param_dtype, attention, remat).
  """
  family = hf.get("model_type")
  if family == "qwen2_5_vl":
    return _vision_language_from_hf(hf, preprocessor, **overrides)
  if family not in _ARCHITECTURES:
    raise CheckpointError(f"config.json model_type={family!r}; supported: "
                          f"{sorted(_ARCHITECTURES)}")
  if hf.get("use_sliding_window"):
    raise CheckpointError("config.json use_sliding_window=true: sliding-window attention is "
                          "not supported")
  if hf.get("mlp_bias"):
    raise CheckpointError("config.json mlp_bias=true is not supported")
  if family not in ("qwen2", "qwen2_moe") and hf.get("attention_bias"):
    raise CheckpointError(f"config.json attention_bias=true is not supported for {family}")
  # rope_parameters is transformers 5's; a rope_scaling (4.x's, the one Qwen's model cards
  # say to add for long contexts) replaces it whole, in 4.x and in 5, rope_theta included.
  rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  heads = hf["num_attention_heads"]
  mla = _mla_from_hf(hf)
  fields = dict(
      family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      # DeepSeek's head_dim is its rope dims (transformers sets it so): ours the whole key's
      head_dim=(hf.get("head_dim") or hf["hidden_size"] // heads if mla is None
                else hf["qk_nope_head_dim"] + mla.rope_dim),
      intermediate_size=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=family == "qwen2" or (family == "qwen2_moe" and hf.get("qkv_bias", True)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_scaling=_rope_scaling_from_hf(rope, hf), moe=_moe_from_hf(hf), mla=mla)
  fields.update(overrides)
  return ModelConfig(**fields)


def _vision_language_from_hf(hf: dict[str, Any], preprocessor: dict[str, Any] | None,
                             **overrides) -> ModelConfig:
  """Qwen2.5-VL's ModelConfig: the decoder's fields at the top level (the hub's files) or in
  text_config (transformers 5's), its RoPE multimodal (rope type "mrope" or "default" with an
  mrope_section), and the vision tower's."""
  text = {**hf, **(hf.get("text_config") or {}), "model_type": "qwen2",
          "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
  rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
  section = rope.pop("mrope_section", None)
  if section is None or rope.pop("type", rope.get("rope_type")) not in ("mrope", "default"):
    raise CheckpointError(f"config.json of qwen2_5_vl: its rope parameters {rope} need an "
                          "mrope_section and rope type mrope or default")
  text.pop("rope_scaling", None)
  text["rope_parameters"] = {**rope, "rope_type": "default"}
  v = hf["vision_config"]
  if v.get("hidden_act", "silu") != "silu" or v.get("in_channels", v.get("in_chans", 3)) != 3:
    raise CheckpointError(f"config.json vision_config: hidden_act {v.get('hidden_act')!r} and "
                          "3 input channels are what Qwen2.5-VL's tower has and all we take")
  pre = preprocessor or {}
  size = pre.get("size") or {}
  for key, ours in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                    ("temporal_patch_size", "temporal_patch_size")):
    if key in pre and pre[key] != v.get(ours, 14 if key == "patch_size" else 2):
      raise CheckpointError(f"{PREPROCESSOR} {key}={pre[key]} differs from config.json's "
                            f"vision_config {ours}={v.get(ours)}")
  bounds = {k: v for k, v in (("min_pixels", size.get("shortest_edge", pre.get("min_pixels"))),
                              ("max_pixels", size.get("longest_edge", pre.get("max_pixels"))),
                              ("image_mean", pre.get("image_mean")),
                              ("image_std", pre.get("image_std"))) if v is not None}
  vision = VisionConfig(
      depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
      num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"],
      image_token_id=hf.get("image_token_id", 151655),
      vision_start_token_id=hf.get("vision_start_token_id", 151652),
      vision_end_token_id=hf.get("vision_end_token_id", 151653),
      video_token_id=hf.get("video_token_id", 151656),
      patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
      spatial_merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
      full_attention_blocks=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
      rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
      tokens_per_second=v.get("tokens_per_second", 4),
      **{k: tuple(x) if isinstance(x, list) else x for k, x in bounds.items()})
  return dataclasses.replace(config_from_hf(text, **overrides), family="qwen2_5_vl",
                             vision=vision, mrope_section=tuple(section))


def _vision_language_to_hf(cfg: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
  """(config.json, preprocessor_config.json) of a qwen2_5_vl config: the decoder's fields at
  the top level as the hub's files hold them (transformers 4.x and 5 read them there)."""
  v = cfg.vision
  hf = config_to_hf(dataclasses.replace(cfg, family="qwen2", vision=None, mrope_section=None))
  section = list(cfg.mrope_section)
  hf.update(architectures=[_ARCHITECTURES["qwen2_5_vl"]], model_type="qwen2_5_vl",
            image_token_id=v.image_token_id, video_token_id=v.video_token_id,
            vision_start_token_id=v.vision_start_token_id,
            vision_end_token_id=v.vision_end_token_id)
  hf["rope_parameters"]["mrope_section"] = section
  hf["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": section}
  hf["vision_config"] = {
      "model_type": "qwen2_5_vl_vision", "depth": v.depth, "hidden_size": v.hidden_size,
      "intermediate_size": v.intermediate_size, "num_heads": v.num_heads,
      "out_hidden_size": v.out_hidden_size, "hidden_act": "silu", "in_channels": 3,
      "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
      "spatial_merge_size": v.spatial_merge_size, "window_size": v.window_size,
      "fullatt_block_indexes": list(v.full_attention_blocks),
      "tokens_per_second": v.tokens_per_second,
      "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
  preprocessor = {
      "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
      "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
      "do_normalize": True, "do_convert_rgb": True, "image_mean": list(v.image_mean),
      "image_std": list(v.image_std), "patch_size": v.patch_size,
      "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
      "min_pixels": v.min_pixels, "max_pixels": v.max_pixels,
      "size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels}}
  return hf, preprocessor


def _moe_from_hf(hf: dict[str, Any]) -> MoeConfig | None:
  """Qwen3-MoE's experts (transformers' configuration_qwen3_moe.py), Qwen2-MoE's with its
  gated shared expert (configuration_qwen2_moe.py) or DeepSeek-V3's
  (configuration_deepseek_v3.py), None for a dense model."""
  if hf.get("model_type") == "deepseek_v3":
    return _deepseek_moe_from_hf(hf)
  if hf.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
    return None
  shared = hf.get("shared_expert_intermediate_size", 0) if hf["model_type"] == "qwen2_moe" else 0
  return MoeConfig(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                   experts_per_token=hf["num_experts_per_tok"],
                   expert_size=hf["moe_intermediate_size"],
                   normalize_weights=bool(hf.get("norm_topk_prob", False)),
                   sparse_step=hf.get("decoder_sparse_step", 1),
                   dense_layers=tuple(hf.get("mlp_only_layers") or ()),
                   shared_size=shared, shared_gate=bool(shared))


# DeepSeek's own config.json fields that transformers ignores (its DeepseekV3 always routes
# so) and SGLang reads: refused when they say otherwise.
_DEEPSEEK_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _deepseek_moe_from_hf(hf: dict[str, Any]) -> MoeConfig:
  """DeepSeek-V3's router and experts: sigmoid scores, the correction bias, n_group groups of
  which topk_group are eligible, weights times routed_scaling_factor, n_shared_experts of
  moe_intermediate_size beside, the first first_k_dense_replace layers dense."""
  for key, value in _DEEPSEEK_ROUTING.items():
    if hf.get(key, value) != value:
      raise CheckpointError(f"config.json {key}={hf[key]!r}: the deepseek_v3 family routes "
                            f"with {key}={value!r} (as transformers' DeepseekV3 does)")
  size = hf["moe_intermediate_size"]
  return MoeConfig(num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
                   experts_per_token=hf["num_experts_per_tok"], expert_size=size,
                   normalize_weights=bool(hf.get("norm_topk_prob", True)),
                   dense_layers=tuple(range(hf.get("first_k_dense_replace") or 0)),
                   scoring="sigmoid", correction_bias=True, groups=hf.get("n_group") or 1,
                   top_groups=hf.get("topk_group") or 1,
                   scaling=float(hf.get("routed_scaling_factor", 1.0)),
                   shared_size=size * (hf.get("n_shared_experts") or 0))


def _mla_from_hf(hf: dict[str, Any]) -> MlaConfig | None:
  """DeepSeek-V3's multi-head latent attention, None for every other family."""
  if hf.get("model_type") != "deepseek_v3":
    return None
  return MlaConfig(kv_rank=hf["kv_lora_rank"], rope_dim=hf["qk_rope_head_dim"],
                   value_dim=hf["v_head_dim"], q_rank=hf.get("q_lora_rank"),
                   rope_interleave=bool(hf.get("rope_interleave", True)))


def _rope_scaling_from_hf(rope: dict[str, Any], hf: dict[str, Any]) -> RopeScaling | None:
  """The scaling that rope parameters `rope` name, with the defaults transformers gives what
  config.json leaves out (modeling_rope_utils: standardize_rope_params and each rule)."""
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return None
  if rope_type not in ROPE_SCALINGS:
    raise CheckpointError(f"config.json rope type {rope_type!r} is not supported "
                          f"(default, {', '.join(ROPE_SCALINGS)})")

  def need(key, value):
    if value is None:
      raise CheckpointError(f"config.json rope type {rope_type!r} needs {key}")
    return value

  max_positions = hf.get("max_position_embeddings")
  if rope_type == "linear":
    return LinearRope(float(need("factor", rope.get("factor"))))
  if rope_type == "dynamic":  # one fixed table, not transformers' per-batch one: see DynamicRope
    return DynamicRope(float(need("factor", rope.get("factor"))),
                       int(need("max_position_embeddings", max_positions)))
  # transformers prefers a top-level original_max_position_embeddings (Phi-3 keeps it there)
  original = int(need("original_max_position_embeddings",
                      hf.get("original_max_position_embeddings")
                      or rope.get("original_max_position_embeddings") or max_positions))
  if rope_type == "llama3":
    return Llama3Rope(float(need("factor", rope.get("factor"))),
                      float(need("low_freq_factor", rope.get("low_freq_factor"))),
                      float(need("high_freq_factor", rope.get("high_freq_factor"))), original)
  factor = float(rope.get("factor") or need("factor or max_position_embeddings",
                                            max_positions) / original)
  attention = rope.get("attention_factor")
  if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
    # DeepSeek's spelling of YaRN's temperature, a ratio of two of the paper's 0.1 ln(s) + 1
    mscale = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
    attention = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
  return YarnRope(factor, original, beta_fast=float(rope.get("beta_fast") or 32),
                  beta_slow=float(rope.get("beta_slow") or 1),
                  truncate=bool(rope.get("truncate", True)),
                  attention_factor=None if attention is None else float(attention),
                  mscale_all_dim=(float(rope["mscale_all_dim"]) if rope.get("mscale_all_dim")
                                  else None))


def _rope_scaling_to_hf(s: RopeScaling) -> dict[str, Any]:
  """Rope parameters for `s` that transformers reads back as `s` (defaults written out)."""
  fields = {k: v for k, v in dataclasses.asdict(s).items() if v is not None}
  if isinstance(s, DynamicRope):
    del fields["max_position_embeddings"]  # config.json's top level, where transformers reads it
  return {"rope_type": s.rope_type, **fields}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """config.json contents for `cfg` (transformers 5 spelling, which 4.x also reads)."""
  if cfg.vision is not None:
    return _vision_language_to_hf(cfg)[0]
  rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  s = cfg.rope_scaling
  if s is not None:
    rope.update(_rope_scaling_to_hf(s))
  max_positions = 32768
  if isinstance(s, DynamicRope):
    max_positions = s.max_position_embeddings
  elif isinstance(s, YarnRope):  # the extended context (transformers warns on any other)
    max_positions = round(s.original_max_position_embeddings * s.factor)
  hf = {"architectures": [_ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
        "dtype": cfg.param_dtype, "max_position_embeddings": max_positions}
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  if cfg.family == "qwen2_moe":
    hf["qkv_bias"] = cfg.qkv_bias
  elif cfg.family != "qwen2":
    hf["attention_bias"] = False
  if cfg.family == "llama":
    hf["mlp_bias"] = False
  if cfg.family == "deepseek_v3":
    hf.update(_deepseek_to_hf(cfg))
  elif cfg.moe is not None:
    m = cfg.moe
    qwen2 = cfg.family == "qwen2_moe"  # its shared expert always gated, absent at width 0
    if (m.scoring, m.correction_bias, m.groups, m.scaling) != ("softmax", False, 1, 1.0) or (
        (m.shared_gate, m.shared_size) != ((bool(m.shared_size), m.shared_size) if qwen2
                                           else (False, 0))):
      raise ValueError(f"hf.save: {cfg.family}'s config.json holds no sigmoid scoring, "
                       "correction bias, expert groups or routed scaling (DeepSeek-V3's "
                       "router), and shared experts only as Qwen2-MoE's gated one; this "
                       f"MoeConfig has others: {m}")
    hf.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
              moe_intermediate_size=m.expert_size, norm_topk_prob=m.normalize_weights,
              decoder_sparse_step=m.sparse_step, mlp_only_layers=list(m.dense_layers),
              router_aux_loss_coef=0.0, output_router_logits=False)
    if qwen2:
      hf["shared_expert_intermediate_size"] = m.shared_size
  return hf


def _deepseek_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """config.json's DeepSeek-V3 fields of `cfg`; ValueError for a MoeConfig they cannot say."""
  m, a = cfg.moe, cfg.mla
  if (m.scoring, m.correction_bias, m.sparse_step, m.dense_layers) != (
      "sigmoid", True, 1, tuple(range(len(m.dense_layers)))) or m.shared_size % m.expert_size:
    raise ValueError("hf.save: DeepSeek-V3's config.json routes by sigmoid with a correction "
                     "bias in every layer from first_k_dense_replace on, with shared experts "
                     f"a multiple of the routed ones' width; this MoeConfig is not that: {m}")
  return {"head_dim": a.rope_dim, "qk_rope_head_dim": a.rope_dim,
          "qk_nope_head_dim": cfg.head_dim - a.rope_dim, "v_head_dim": a.value_dim,
          "kv_lora_rank": a.kv_rank, "q_lora_rank": a.q_rank,
          "rope_interleave": a.rope_interleave, "n_routed_experts": m.num_experts,
          "num_experts_per_tok": m.experts_per_token, "moe_intermediate_size": m.expert_size,
          "n_shared_experts": m.shared_size // m.expert_size, "norm_topk_prob": m.normalize_weights,
          "n_group": m.groups, "topk_group": m.top_groups, "routed_scaling_factor": m.scaling,
          "first_k_dense_replace": len(m.dense_layers), "num_nextn_predict_layers": 0,
          **_DEEPSEEK_ROUTING}


# ---- tensor names ----

class _Tensor(NamedTuple):
  hf_name: str
  path: tuple[str, ...]  # into our params pytree
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _tensors(cfg: ModelConfig) -> list[_Tensor]:
  """Every tensor of `cfg`'s checkpoint, in Hugging Face's order."""
  h, d = cfg.hidden_size, cfg.head_dim
  same = lambda x: x
  linear = (lambda w: w.T, lambda k: k.T)

  def split_heads(heads):  # weight[heads*d, h] <-> kernel[h, heads, d]; bias [heads*d] <-> [heads, d]
    return ((lambda w: w.T.reshape(h, heads, d), lambda k: k.reshape(h, heads * d).T),
            (lambda b: b.reshape(heads, d), lambda b: b.reshape(heads * d)))

  out = [_Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), same, same)]
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", (f"layers_{i}",)
    attn = ours + ("self_attn",)
    if cfg.mla is not None:
      out += _latent_attention_tensors(cfg, f"{hf}self_attn.", attn)
    else:
      for name, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads),
                          ("v_proj", cfg.num_kv_heads)):
        weight, bias = split_heads(heads)
        out.append(_Tensor(f"{hf}self_attn.{name}.weight", attn + (name, "kernel"), *weight))
        if cfg.qkv_bias:
          out.append(_Tensor(f"{hf}self_attn.{name}.bias", attn + (name, "bias"), *bias))
      out.append(_Tensor(f"{hf}self_attn.o_proj.weight", attn + ("o_proj", "kernel"),
                         lambda w: w.T.reshape(cfg.num_heads, d, h),
                         lambda k: k.reshape(cfg.num_heads * d, h).T))
    if cfg.qk_norm:
      for name in ("q_norm", "k_norm"):
        out.append(_Tensor(f"{hf}self_attn.{name}.weight", attn + (name, "scale"), same, same))
    if cfg.sparse(i):  # on disk one tensor per expert, ours stacked: slice e of [E, in, out]
      mlp = ours + ("mlp",)
      out.append(_Tensor(f"{hf}mlp.gate.weight", mlp + ("gate", "kernel"), *linear))
      if cfg.moe.correction_bias:
        out.append(_Tensor(f"{hf}mlp.gate.e_score_correction_bias",
                           mlp + ("e_score_correction_bias",), same, same))
      for e in range(cfg.moe.num_experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
          out.append(_Tensor(f"{hf}mlp.experts.{e}.{name}.weight",
                             mlp + (f"experts_{name}", e), *linear))
      if cfg.moe.shared_size:  # Qwen2-MoE's one gated shared expert, DeepSeek's several
        shared = "shared_expert" if cfg.moe.shared_gate else "shared_experts"
        for name in ("gate_proj", "up_proj", "down_proj"):
          out.append(_Tensor(f"{hf}mlp.{shared}.{name}.weight",
                             mlp + ("shared_experts", name, "kernel"), *linear))
      if cfg.moe.shared_gate:
        out.append(_Tensor(f"{hf}mlp.shared_expert_gate.weight",
                           mlp + ("shared_expert_gate", "kernel"), *linear))
    else:
      for name in ("gate_proj", "up_proj", "down_proj"):
        out.append(_Tensor(f"{hf}mlp.{name}.weight", ours + ("mlp", name, "kernel"), *linear))
    for name in ("input_layernorm", "post_attention_layernorm"):
      out.append(_Tensor(f"{hf}{name}.weight", ours + (name, "scale"), same, same))
  out.append(_Tensor("model.norm.weight", ("norm", "scale"), same, same))
  if not cfg.tie_embeddings:
    out.append(_Tensor("lm_head.weight", ("lm_head",), *linear))
  if cfg.vision is not None:
    out += _vision_tensors(cfg.vision)
  return out


def weight_paths(cfg: ModelConfig) -> dict[str, tuple]:
  """{Hugging Face tensor name: its path in our params} of every tensor of `cfg`'s checkpoint;
  a routed expert's path ends with its index into the stacked kernel."""
  return {t.hf_name: t.path for t in _tensors(cfg)}


def _vision_tensors(v: VisionConfig) -> list[_Tensor]:
  """Qwen2.5-VL's vision tower's tensors (`visual.*`, params under "visual")."""
  same = lambda x: x
  linear = (lambda w: w.T, lambda k: k.T)
  ours = ("visual",)
  # Conv3d weight[out, 3, t, p, p] over patches flattened (channel, frame, row, column)
  patch = (lambda w: w.reshape(w.shape[0], -1).T,
           lambda k: k.T.reshape(-1, 3, v.temporal_patch_size, v.patch_size, v.patch_size))
  out = [_Tensor("visual.patch_embed.proj.weight", ours + ("patch_embed", "kernel"), *patch)]
  dense = lambda hf, path: [_Tensor(f"{hf}.weight", path + ("kernel",), *linear),
                            _Tensor(f"{hf}.bias", path + ("bias",), same, same)]
  for i in range(v.depth):
    hf, block = f"visual.blocks.{i}.", ours + (f"blocks_{i}",)
    for name in ("norm1", "norm2"):
      out.append(_Tensor(f"{hf}{name}.weight", block + (name, "scale"), same, same))
    out += dense(f"{hf}attn.qkv", block + ("qkv",)) + dense(f"{hf}attn.proj", block + ("proj",))
    for name in ("gate_proj", "up_proj", "down_proj"):
      out += dense(f"{hf}mlp.{name}", block + (name,))
  out.append(_Tensor("visual.merger.ln_q.weight", ours + ("merger_ln_q", "scale"), same, same))
  for k in (0, 2):
    out += dense(f"visual.merger.mlp.{k}", ours + (f"merger_mlp_{k}",))
  return out


def _latent_attention_tensors(cfg: ModelConfig, hf: str, ours: tuple) -> list[_Tensor]:
  """A DeepSeek-V3 layer's attention tensors (names `hf` + ..., params under `ours`)."""
  m, heads, d = cfg.mla, cfg.num_heads, cfg.head_dim
  same = lambda x: x

  def linear(*out_shape):  # weight[out, in] <-> kernel[in, *out_shape]
    return (lambda w: w.T.reshape(w.shape[1], *out_shape),
            lambda k: k.reshape(k.shape[0], -1).T)

  query = [("q_proj", linear(heads, d))] if m.q_rank is None else [
      ("q_a_proj", linear(m.q_rank)), ("q_b_proj", linear(heads, d))]
  out = [_Tensor(f"{hf}{name}.weight", ours + (name, "kernel"), *fns) for name, fns in query]
  if m.q_rank is not None:
    out.append(_Tensor(f"{hf}q_a_layernorm.weight", ours + ("q_a_layernorm", "scale"), same,
                       same))
  return out + [
      _Tensor(f"{hf}kv_a_proj_with_mqa.weight", ours + ("kv_a_proj_with_mqa", "kernel"),
              *linear(m.kv_rank + m.rope_dim)),
      _Tensor(f"{hf}kv_a_layernorm.weight", ours + ("kv_a_layernorm", "scale"), same, same),
      _Tensor(f"{hf}kv_b_proj.weight", ours + ("kv_b_proj", "kernel"),
              *linear(heads, d - m.rope_dim + m.value_dim)),
      _Tensor(f"{hf}o_proj.weight", ours + ("o_proj", "kernel"),
              lambda w: w.T.reshape(heads, m.value_dim, cfg.hidden_size),
              lambda k: k.reshape(heads * m.value_dim, cfg.hidden_size).T)]


# ---- quantized tensors ----

def _quantized(t: _Tensor) -> bool:
  """Whether a quantized checkpoint stores `t` quantized: the decoder layers' projections (not
  yet a mixture's experts)."""
  return (t.hf_name.startswith("model.layers.")
          and t.hf_name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
          and ".experts." not in t.hf_name)


def _stored_names(t: _Tensor, quantization: str | None) -> list[str]:
  """The checkpoint tensors that hold `t` (formats.md 3.2 and 3.4 for the quantized ones)."""
  if quantization is None or not _quantized(t):
    return [t.hf_name]
  base = t.hf_name.removesuffix(".weight")
  if quantization == "fp8":
    return [t.hf_name, f"{base}.weight_scale_inv"]
  return [f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"]


def _to_stored(t: _Tensor, weight: np.ndarray, quantization: str | None,
               dtype) -> dict[str, np.ndarray]:
  """`t`'s weight in HF's layout ([out, in] for a projection), as the checkpoint stores it."""
  names = _stored_names(t, quantization)
  if len(names) == 1:
    return {names[0]: np.ascontiguousarray(weight.astype(dtype))}
  w = jnp.asarray(weight, jnp.float32)
  if quantization == "fp8":
    q, scale = quantize.fp8_quantize(w)
    return dict(zip(names, (np.asarray(q), np.asarray(scale, np.float32))))
  packed, scale = quantize.int4_quantize(w, scale_dtype=dtype)
  return dict(zip(names, (np.asarray(packed), np.asarray(scale),
                          np.asarray(weight.shape, np.int64))))


def _from_stored(name: str, stored: list[np.ndarray], quantization: str | None) -> np.ndarray:
  """The inverse of `_to_stored`: the weight in HF's layout, dequantized to float32."""
  if len(stored) == 1:
    return stored[0]
  if quantization == "fp8":
    return np.asarray(quantize.fp8_dequantize(jnp.asarray(stored[0]), jnp.asarray(stored[1])))
  packed, scale, shape = stored
  weight = np.asarray(quantize.int4_dequantize(jnp.asarray(packed), jnp.asarray(scale)))
  if list(weight.shape) != [int(n) for n in shape]:
    raise CheckpointError(f"{name}: weight_shape {list(shape)} does not match its packed "
                          f"weights and scales ({list(weight.shape)})")
  return weight


def _packed(t: _Tensor, stored: list[np.ndarray], quantization: str, shape, dtype: str,
            fname: str) -> quantize.Packed:
  """Projection `t`'s stored tensors (weight_shape dropped) as the quantize.Packed of a kernel
  of `shape`; CheckpointError when their shapes are not what that kernel packs to."""
  inputs = quantize.projection_inputs(t.path)
  expected = jax.eval_shape(lambda k: quantize.pack(k, quantization, inputs),
                            jax.ShapeDtypeStruct(shape, jnp.float32)).stored
  arrays = stored[:len(expected)]
  if [x.shape for x in arrays] != [x.shape for x in expected]:
    raise CheckpointError(f"{fname}: {t.hf_name} is stored as {[x.shape for x in arrays]}, "
                          f"the config's kernel {tuple(shape)} packs to "
                          f"{[x.shape for x in expected]}")
  return quantize.Packed(tuple(jax.device_put(x) for x in arrays), quantization, tuple(shape),
                         inputs, dtype)


def _quantization_of(hf: dict[str, Any]) -> str | None:
  """The weight format of config.json `hf`: None, "fp8" or "int4"; CheckpointError for a
  quantization_config this reader does not take."""
  qc = hf.get("quantization_config")
  if qc is None:
    return None
  weights = (qc.get("config_groups") or {}).get("group_0", {}).get("weights") or {}
  if (qc.get("quant_method") == "fp8"
      and list(qc.get("weight_block_size") or []) == list(quantize.FP8_BLOCK)):
    return "fp8"
  if (qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized"
      and weights.get("num_bits") == 4 and weights.get("strategy") == "group"
      and weights.get("group_size") == quantize.INT4_GROUP and weights.get("symmetric")):
    return "int4"
  raise CheckpointError(f"quantization_config {qc} is not one longrl reads: fp8 with "
                        f"{list(quantize.FP8_BLOCK)} blocks, or compressed-tensors "
                        f"pack-quantized symmetric int4 in groups of {quantize.INT4_GROUP}")


def _read(path: str, name: str) -> np.ndarray:
  """Tensor `name` of safetensors file `path`. F8_E4M3 tensors are read from the file's
  header and bytes: safetensors' numpy reader asks numpy for a float8 type it does not have."""
  with safe_open(path, "numpy") as f:
    try:
      return f.get_tensor(name)
    except AttributeError:  # numpy has no float8_e4m3fn
      pass
  with open(path, "rb") as f:
    (length,) = struct.unpack("<Q", f.read(8))
    entry = json.loads(f.read(length))[name]
    if entry["dtype"] != "F8_E4M3":
      raise CheckpointError(f"{path}: tensor {name} of dtype {entry['dtype']} cannot be read")
    start, end = entry["data_offsets"]
    f.seek(8 + length + start)
    data = f.read(end - start)
  return np.frombuffer(data, ml_dtypes.float8_e4m3fn).reshape(entry["shape"])


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ---- import ----

def read_config(ckpt_dir: str, **overrides) -> ModelConfig:
  path = os.path.join(ckpt_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"no config.json in {ckpt_dir}")
  with open(path) as f:
    hf = json.load(f)
  preprocessor = None
  if os.path.isfile(pre := os.path.join(ckpt_dir, PREPROCESSOR)):
    with open(pre) as f:
      preprocessor = json.load(f)
  return config_from_hf(hf, preprocessor, **overrides)


def _weight_files(ckpt_dir: str) -> dict[str, str]:
  """HF tensor name -> file, from the index or the single-file checkpoint."""
  index = os.path.join(ckpt_dir, INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      return json.load(f)["weight_map"]
  single = os.path.join(ckpt_dir, SINGLE)
  if not os.path.isfile(single):
    raise CheckpointError(f"{ckpt_dir} has neither {INDEX} nor {SINGLE}")
  with safe_open(single, "numpy") as f:
    return {name: SINGLE for name in f.keys()}


def load(ckpt_dir: str, cfg: ModelConfig | None = None, *, shardings=None, packed=False,
         **overrides):
  """(cfg, params) from a local checkpoint directory.

  cfg: defaults to the one read from config.json (with `overrides`). shardings: an optional
  pytree of jax.sharding.Sharding shaped like the params (models.sharding.param_shardings);
  each tensor goes straight to its shards. Tensors are cast to cfg.param_dtype. A quantized
  checkpoint's projections are dequantized, or with `packed` kept as stored (quantize.Packed,
  which the model dequantizes on the fly: a server's weights at rest; no shardings then).
  Raises CheckpointError naming any missing, unexpected or misshapen tensor.
  """
  cfg = cfg or read_config(ckpt_dir, **overrides)
  with open(os.path.join(ckpt_dir, "config.json")) as f:
    quantization = _quantization_of(json.load(f))
  files = _weight_files(ckpt_dir)
  expected = _tensors(cfg)
  wanted = {name for t in expected for name in _stored_names(t, quantization)}
  # DeepSeek-V3's multi-token-prediction modules, layers past the last, transformers skips too
  extra_layers = f"model.layers.{cfg.num_layers}." if cfg.family == "deepseek_v3" else None
  unexpected = sorted(n for n in files if n not in wanted and "rotary_emb" not in n
                      and not (extra_layers and n.startswith(extra_layers)))
  missing = sorted(wanted - set(files))
  if cfg.tie_embeddings and "lm_head.weight" in unexpected:
    unexpected.remove("lm_head.weight")  # some tied checkpoints store the copy anyway
  if missing or unexpected:
    raise CheckpointError(f"{ckpt_dir} does not match the {cfg.family} config: missing "
                          f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                          f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
  dtype = _DTYPES[cfg.param_dtype]
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  params: dict = {}
  stacks: dict[tuple, tuple[np.ndarray, set]] = {}  # experts' params being filled, on the host
  # File by file, in HF's order.
  for t in sorted(expected, key=lambda t: files[_stored_names(t, quantization)[0]]):
    names = _stored_names(t, quantization)
    fname = files[names[0]]
    # One open per tensor: safe_open maps the file, and every page a read touches counts in
    # this process's resident memory until the file is closed (a second copy of the model).
    stored = [_read(os.path.join(ckpt_dir, files[name]), name) for name in names]
    # An expert's tensor is slice `expert` of its stacked param at `path`.
    path, expert = (t.path[:-1], t.path[-1]) if isinstance(t.path[-1], int) else (t.path, None)
    full = _get(shapes, path).shape
    want = full if expert is None else full[1:]
    if packed and len(stored) > 1:
      _set(params, t.path, _packed(t, stored, quantization, want, cfg.param_dtype, fname))
      continue
    value = t.to_ours(_from_stored(t.hf_name, stored, quantization))  # a view, unquantized
    del stored
    if value.shape != want:
      raise CheckpointError(f"{fname}: tensor {t.hf_name} has shape {value.shape} in our "
                            f"layout, the config needs {want}")
    sharding = None if shardings is None else _get(shardings, path)
    if expert is not None:
      stack, filled = stacks.setdefault(path, (np.empty(full, _dtype(t, dtype)), set()))
      stack[expert], value = value, None
      filled.add(expert)
      if len(filled) < full[0]:
        continue
      value = stacks.pop(path)[0]
    _set(params, path, _place(value, _dtype(t, dtype), sharding))
    del value
  return cfg, params


def _place(value: np.ndarray, dtype, sharding) -> jax.Array:
  """Host array `value` (any strides) cast to `dtype` on its devices. With a sharding each
  addressable device gets its own slice, cut and cast one shard at a time, so the host holds
  the tensor plus one shard, never a second whole copy; the transfers finish before the next
  tensor is read."""
  if sharding is None:
    return jax.device_put(np.ascontiguousarray(value, dtype=dtype)).block_until_ready()
  return jax.make_array_from_callback(
      value.shape, sharding, lambda index: np.ascontiguousarray(value[index], dtype=dtype)
  ).block_until_ready()


def _dtype(t: _Tensor, dtype):
  """The dtype param `t` is held and written in: float32 for _FLOAT32's, else `dtype`."""
  return np.dtype(np.float32) if t.path[-1] in _FLOAT32 else np.dtype(dtype)


# ---- export ----

def _cast(x, dtype: np.dtype):
  """x in `dtype`, cast on its device when it is a JAX array."""
  return x.astype(dtype) if isinstance(x, jax.Array) else x


def save(params, cfg: ModelConfig, out_dir: str, *, max_shard_bytes: int = 2 * 2**30,
         copy_from: str | None = None, workers: int = 1,
         quantization: str | None = None) -> str:
  """Write `params` as a Hugging Face checkpoint directory; returns out_dir.

  Files: config.json, model-0000k-of-0000n.safetensors and model.safetensors.index.json (a
  single model.safetensors when everything fits one shard), plus the tokenizer and generation
  files found in `copy_from`. Shards are planned from the shapes, then written `workers` at a
  time (threads: the copies off the device and the writes leave the GIL), so host memory holds
  at most `workers` shards. Tensors are cast to cfg.param_dtype where they are (a bf16 export
  of float32 weights moves half the bytes off the device). The same params always give the
  same bytes. `quantization` ("fp8" or "int4"): the decoder layers' projections are written in
  that format, with its quantization_config (QUANTIZATIONS; the module docstring says which).
  """
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ValueError(f"hf.save: unknown quantization {quantization!r}; choose one of "
                     f"{sorted(QUANTIZATIONS)} or None")
  hf_config = config_to_hf(cfg)  # first: it refuses what no config.json could say
  os.makedirs(out_dir, exist_ok=True)
  dtype = np.dtype(_DTYPES[cfg.param_dtype])
  plan: list[list[_Tensor]] = [[]]
  size = 0
  for t in _tensors(cfg):
    nbytes = int(np.prod(_get(params, t.path).shape)) * _dtype(t, dtype).itemsize
    if plan[-1] and size + nbytes > max_shard_bytes:
      plan.append([])
      size = 0
    plan[-1].append(t)
    size += nbytes
  names = ([SINGLE] if len(plan) == 1 else
           [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))])
  def write(fname: str, tensors: list[_Tensor]) -> dict[str, int]:
    shard = {}
    for t in tensors:
      weight = t.to_hf(np.asarray(jax.device_get(_cast(_get(params, t.path), _dtype(t, dtype)))))
      shard.update(_to_stored(t, weight, quantization, _dtype(t, dtype)))
    save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    return {name: x.nbytes for name, x in shard.items()}

  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    written = list(pool.map(write, names, plan))
    weight_map = {name: fname for fname, shard in zip(names, written) for name in shard}
  if len(plan) > 1:
    total = sum(n for shard in written for n in shard.values())
    with open(os.path.join(out_dir, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
  if quantization is not None:
    hf_config["quantization_config"] = QUANTIZATIONS[quantization]
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  if cfg.vision is not None:
    with open(os.path.join(out_dir, PREPROCESSOR), "w") as f:
      json.dump(_vision_language_to_hf(cfg)[1], f, indent=2, sort_keys=True)
  if copy_from:
    for name in TOKENIZER_FILES:
      src = os.path.join(copy_from, name)
      if os.path.isfile(src):
        shutil.copyfile(src, os.path.join(out_dir, name))
  return out_dir
