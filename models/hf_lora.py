"""LoRA adapters as a PEFT directory (adapter_config.json and adapter_model.safetensors), in and
out: what `peft.PeftModel.from_pretrained` loads over the transformers model, and what SGLang
0.5.23 loads with /load_lora_adapter or --lora-paths (sglang srt/lora/lora_config.py reads
`r`, `lora_alpha` and `target_modules` from adapter_config.json).

Owns the mapping between our adapter tree (models/lora.py: a [*inputs, r], b [r, *outputs] at
a kernel's path) and PEFT's tensors, named `base_model.model.<module>.lora_A.weight` [r, in]
and `.lora_B.weight` [out, r] with <module> the Hugging Face module of the kernel
(models/hf.py's names); a routed expert's adapter is written per expert
(`...mlp.experts.<e>.gate_proj.lora_A.weight`), the layout SGLang and transformers 4 models
name, which PEFT converts to transformers 5's fused experts on loading.

Ranks and scales: SGLang applies one scale to a whole adapter, lora_alpha / r
(srt/lora/lora.py, `self.scaling = self.config.lora_alpha / self.config.r`), ignoring PEFT's
rank_pattern and alpha_pattern, and PEFT, converting per-expert adapters to transformers 5's
fused experts, gives every expert rank r (peft utils/transformers_weight_conversion.py sets the
fused rank to r times the branches). Our routed experts have rank r_e = max(1, r // experts)
and scale alpha / r_e, so an expert's adapter is written at rank r, zero-padded, its B times
r / r_e: the same product under the one scale alpha / r. `load_adapter` trims such padding
(rows of A and B that are exactly zero past r_e, which no trained adapter has) and unfolds B.
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models import hf, lora, quantize, transformer
from models.config import ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _modules(cfg: ModelConfig):
  """(HF module name, kernel path in params, expert index or None) of every kernel of `cfg`
  LoRA could adapt, in the checkpoint's order."""
  for name, path in hf.weight_paths(cfg).items():
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
      continue
    module = name.removesuffix(".weight")
    if path[-1] == "kernel" and path[-2] in lora.PROJECTIONS:
      yield module, path, None
    elif isinstance(path[-1], int) and path[-2].startswith("experts_"):
      yield module, path[:-1], path[-1]


def _adapter_at(adapters, path):
  """The Adapter at kernel path `path` of `adapters`, or None."""
  for key in path:
    if not isinstance(adapters, dict) or key not in adapters:
      return None
    adapters = adapters[key]
  return adapters if isinstance(adapters, lora.Adapter) else None


def save_adapter(adapters, cfg: ModelConfig, lora_cfg: lora.LoraConfig, out_dir: str, *,
                 base: str | None = None) -> str:
  """Write `adapters` (models/lora.py's tree, made with `lora_cfg` for a model of `cfg`) as a
  PEFT directory `out_dir`, in float32; `base`: the base model's path or hub id, recorded as
  base_model_name_or_path. Returns out_dir."""
  tensors, targets, host = {}, set(), {}
  for module, path, expert in _modules(cfg):
    adapter = _adapter_at(adapters, path)
    if adapter is None:
      continue
    if path not in host:  # once per kernel, not once per expert
      # B times our scale over SGLang's one (alpha / r): 1 but for routed experts.
      fold = adapter.scale * lora_cfg.rank / lora_cfg.alpha
      host[path] = (np.asarray(jax.device_get(adapter.a), np.float32),
                    np.asarray(jax.device_get(adapter.b), np.float32) * np.float32(fold))
    a, b = host[path]
    rank = a.shape[-1]
    if expert is None:
      lora_a, lora_b = a.reshape(-1, rank).T, b.reshape(rank, -1).T
    else:  # [r_e, in] and [out, r_e], zero-padded to rank r
      pad = lora_cfg.rank - rank
      lora_a = np.pad(a[expert].T, ((0, pad), (0, 0)))
      lora_b = np.pad(b[expert].T, ((0, 0), (0, pad)))
    targets.add(module.rsplit(".", 1)[1])
    tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
    tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
  if not tensors:
    raise ValueError("save_adapter: the adapters adapt no kernel of this model config")
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
      "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "target_modules": sorted(targets),
      "rank_pattern": {}, "alpha_pattern": {},
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
      "inference_mode": True}
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, CONFIG), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return out_dir


def _pattern(patterns: dict, module: str, default):
  """PEFT's per-module value: the first key of `patterns` that ends `module` (peft
  utils/other.py get_pattern_key), else `default`."""
  for key, value in patterns.items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _config_json(adapter_dir: str) -> dict:
  path = os.path.join(adapter_dir, CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{adapter_dir}: no {CONFIG} (not a PEFT adapter directory)")
  with open(path) as f:
    return json.load(f)


def read_config(adapter_dir: str, as_sglang: bool = False) -> lora.LoraConfig:
  """The LoraConfig of PEFT directory `adapter_dir`. ValueError for what we cannot compute as
  PEFT and SGLang would: another PEFT type, rsLoRA, DoRA, biases, fan_in_fan_out
  (`as_sglang`: another PEFT type and DoRA only, the rest ignored as SGLang ignores it)."""
  return _lora_config(_config_json(adapter_dir), os.path.join(adapter_dir, CONFIG), as_sglang)


def _lora_config(config: dict, path: str, as_sglang: bool) -> lora.LoraConfig:
  checked = (("peft_type", "LORA"), ("use_dora", False)) + ((
      ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)) if not as_sglang
      else ())
  problems = [f"{key}={config.get(key)!r}" for key, want in checked
              if config.get(key, want) != want]
  if problems:
    raise ValueError(f"{path}: {', '.join(problems)}; only plain LoRA (alpha / r, no biases) "
                     "is supported, as SGLang computes it")
  targets = config["target_modules"]
  if as_sglang and targets in ("all", "all-linear"):  # sglang srt/lora/utils.py L289-296
    targets = lora.PROJECTIONS
  if isinstance(targets, str):  # a regex: SGLang takes names, or "all" / "all-linear"
    raise ValueError(f"{path}: target_modules {targets!r}; a list of module names is needed")
  cfg = lora.LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                        targets=tuple(sorted(targets)))
  try:
    cfg.check()
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  return cfg


def load_adapter(adapter_dir: str, cfg: ModelConfig, *,
                 as_sglang: bool = False) -> tuple[dict, lora.LoraConfig]:
  """(adapters, LoraConfig) of PEFT directory `adapter_dir` for a model of `cfg`: the adapter
  tree models/lora.py attaches, in float32, each adapter's product PEFT's for its module
  (lora_alpha / r, or its rank_pattern / alpha_pattern entries; a routed expert's B unfolded
  as `save_adapter` folds it), or with `as_sglang` SGLang's, lora_alpha / r everywhere
  (sglang srt/lora/lora.py L71; lora_config.py reads no pattern). ValueError naming a tensor
  that fits no kernel of `cfg`, a missing half of a pair, or a shape that does not fit."""
  config = _config_json(adapter_dir)
  lora_cfg = _lora_config(config, os.path.join(adapter_dir, CONFIG), as_sglang)
  path = os.path.join(adapter_dir, WEIGHTS)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{adapter_dir}: no {WEIGHTS}")
  with safe_open(path, "numpy") as f:
    stored = {name: f.get_tensor(name) for name in f.keys()}
  shapes = dict(_kernel_shapes(cfg))
  adapters, experts = {}, {}  # kernel path -> Adapter; kernel path -> {expert: (A, B, scale)}
  for module, kernel, expert in _modules(cfg):
    key = f"{_PREFIX}{module}"
    names = (f"{key}.lora_A.weight", f"{key}.lora_B.weight")
    if not any(name in stored for name in names):
      continue
    missing = [name for name in names if name not in stored]
    if missing:
      raise ValueError(f"{path}: {missing[0]} is missing (LoRA needs both A and B)")
    lora_a, lora_b = (stored.pop(name).astype(np.float32) for name in names)
    rank, shape = lora_a.shape[0], shapes[kernel]
    if expert is None:  # [*inputs, *outputs]
      inputs = quantize.projection_inputs(kernel)
      dims_in, dims_out = shape[:inputs], shape[inputs:]
    else:  # [experts, in, out]
      dims_in, dims_out = shape[1:2], shape[2:]
    if lora_a.shape[1] != math.prod(dims_in) or lora_b.shape != (math.prod(dims_out), rank):
      raise ValueError(f"{path}: {key}'s A {lora_a.shape} and B {lora_b.shape} do not fit "
                       f"its kernel {shape}")
    peft_scale = lora_cfg.alpha / lora_cfg.rank if as_sglang else (
        _pattern(config.get("alpha_pattern") or {}, module, lora_cfg.alpha)
        / _pattern(config.get("rank_pattern") or {}, module, lora_cfg.rank))
    if expert is None:
      adapters[kernel] = _ours(lora_a.T.reshape(*dims_in, rank),
                               lora_b.T.reshape(rank, *dims_out), peft_scale, lora_cfg.alpha)
    else:
      experts.setdefault(kernel, {})[expert] = (lora_a.T, lora_b.T, peft_scale)
  for kernel, by_expert in experts.items():
    count = shapes[kernel][0]
    if sorted(by_expert) != list(range(count)):
      raise ValueError(f"{path}: adapters for experts {sorted(by_expert)} of "
                       f"{'/'.join(kernel)}, which has {count}")
    adapters[kernel] = _experts_adapter([by_expert[e] for e in range(count)], lora_cfg)
  if stored:
    raise ValueError(f"{path}: tensors that fit no projection of this model config: "
                     f"{sorted(stored)[:4]}{' ...' if len(stored) > 4 else ''}")
  tree: dict = {}
  for kernel, adapter in adapters.items():
    lora._set(tree, kernel, adapter)
  return tree, lora_cfg


def _experts_adapter(by_expert, lora_cfg: lora.LoraConfig) -> lora.Adapter:
  """One Adapter of a routed-experts kernel from its experts' (A [in, R], B [R, out], PEFT
  scale), the zero padding `save_adapter` adds past our rank r // E trimmed."""
  a = np.stack([a for a, _, _ in by_expert])  # [E, in, R]
  b = np.stack([b for _, b, _ in by_expert])  # [E, R, out]
  rank = max(1, lora_cfg.rank // len(by_expert))
  if rank < a.shape[-1] and not a[..., rank:].any() and not b[:, rank:].any():
    a, b = a[..., :rank], b[:, :rank]
  return _ours(a, b, by_expert[0][2], lora_cfg.alpha, experts=True)


def _ours(a: np.ndarray, b: np.ndarray, peft_scale: float, alpha: float,
          experts: bool = False) -> lora.Adapter:
  """The Adapter computing peft_scale a b at our scale, alpha / its rank (B the rest)."""
  scale = alpha / a.shape[-1]
  return lora.Adapter(jnp.asarray(a), jnp.asarray(b * np.float32(peft_scale / scale)), scale,
                      experts)


def _kernel_shapes(cfg: ModelConfig):
  """(path, shape) of every param of `cfg`, computed without allocating them."""
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    yield tuple(k.key for k in path), leaf.shape
