"""A pretrained Hugging Face checkpoint as a run's model: `train.model = @HFCheckpoint()`.

Owns what a run takes from a checkpoint directory and gives back to it: the model config
(config.json, with how it computes as bindings: bf16 compute over float32 master weights by
default), the tokenizer and its chat format (tokenizer.json, the chat template of
chat_template.jinja or tokenizer_config.json, a system prompt, template options such as
Qwen3's enable_thinking), the starting params (read tensor by tensor straight into their
shards on the run's mesh, no SFT warm start), which are also the reference policy of a KL
term (read again from the directory, not copied into the run), and the run's export: a
complete Hugging Face directory (weights, config.json and the checkpoint's tokenizer files)
that transformers and SGLang load as it is.
"""

import dataclasses
import os
from typing import Any, Mapping, Optional

import jax

from models import hf, sharding, transformer
from models.config import ModelConfig
from models.tokenizer import ChatPrompts, HFTokenizer
from rl import ConfigError


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """The Hugging Face checkpoint directory `path` (config.json, safetensors, tokenizer.json,
  tokenizer_config.json) as the run's model, tokenizer and starting params.

  `dtype`: the compute dtype; `param_dtype`: the master weights' and the optimizer state's
  (and the export's); `attention`, `remat`, `weight_format` (quantization-aware training: the
  trainer computes on its projections rounded to "fp8" or "int4"): as in ModelConfig.
  `system_prompt` and
  `template_args` (e.g. {'enable_thinking': False}) shape every prompt under the chat
  template (models.tokenizer.ChatPrompts); the instruction after the problem is the task's
  template (e.g. MathTask.template)."""
  path: str
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  attention: str = "auto"
  remat: str = "none"
  weight_format: Optional[str] = None
  system_prompt: Optional[str] = None
  template_args: Optional[Mapping[str, Any]] = None

  def check(self, tokenizer=None, processes: int = 1) -> None:
    """ConfigError naming what the directory lacks or holds that we cannot read (as the run's
    model, and as its start: rl.trainer.Start, for any tokenizer and processes)."""
    del tokenizer, processes
    if not self.path:
      raise ConfigError("HFCheckpoint.path is not set: name a Hugging Face checkpoint "
                        "directory (a recipe's --gin_param \"CHECKPOINT = '/path'\")")
    if not os.path.isdir(self.path):
      raise ConfigError(f"HFCheckpoint.path={self.path!r} is not a directory")
    missing = [name for name in ("config.json", "tokenizer.json")
               if not os.path.isfile(os.path.join(self.path, name))]
    if missing:
      raise ConfigError(f"HFCheckpoint.path={self.path!r} has no {' or '.join(missing)}")
    try:
      self(0)
    except (hf.CheckpointError, ValueError) as e:
      raise ConfigError(f"HFCheckpoint.path={self.path!r}: {e}") from None

  def __call__(self, vocab_size: int) -> ModelConfig:
    """The model config of config.json (a model factory, as models.config.tiny is; the
    vocabulary is the checkpoint's, which the trainer checks against the tokenizer's)."""
    del vocab_size
    return hf.read_config(self.path, dtype=self.dtype, param_dtype=self.param_dtype,
                          attention=self.attention, remat=self.remat,
                          weight_format=self.weight_format)

  def tokenizer(self) -> ChatPrompts:
    return ChatPrompts(HFTokenizer(self.path), system_prompt=self.system_prompt,
                       template_args=dict(self.template_args or {}))

  def load(self, cfg: ModelConfig, shardings=None) -> Any:
    """The checkpoint's params in `cfg`'s param dtype, each tensor placed on its
    `shardings` (a pytree like the params; None: one device) as it is read; CheckpointError
    names a missing or misshapen tensor."""
    return hf.load(self.path, cfg, shardings=shardings)[1]

  # The start protocol (rl.trainer): where the params begin and what the reference is.

  def initial(self, cfg: ModelConfig, mesh, seed: int) -> Any:
    del seed
    shardings = None
    if mesh is not None:
      shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
      shardings = sharding.param_shardings(shapes, mesh)
    return self.load(cfg, shardings)

  def params(self, initial, cfg: ModelConfig, task, tokenizer, **_) -> tuple[Any, dict]:
    return initial, {"sft_loss": None, "init_from": self.path}

  def keep(self, run_dir: str, params) -> None:
    """Nothing to save: the directory itself is the reference policy."""

  def reference(self, run_dir: str, like) -> Any:
    """The starting params again, placed as `like` (the run's params) is."""
    return self.load(self(0), jax.tree.map(lambda x: x.sharding, like))

  def export(self, params, cfg: ModelConfig, out_dir: str) -> str:
    """`params` as a complete Hugging Face directory at `out_dir`, with this checkpoint's
    tokenizer and generation files."""
    return hf.save(params, cfg, out_dir, copy_from=self.path)
