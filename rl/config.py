"""The sizes of an RL run: how many steps, prompts, samples and tokens, and how updates split.

Owns `RLConfig`. What a step optimizes (loss, rewards, corrections) is rl.trainer.Objective,
how its rollouts are scheduled is a rollout source (rl/sources.py); neither is a flag here.
"""

import dataclasses
from typing import Optional

from models.lora import LoraConfig
from rl import ConfigError, kl


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """num_steps RL steps; each draws prompts_per_step prompts, samples samples_per_prompt
  completions of each (at most max_new_tokens policy tokens, at temperature / top_p), and
  makes `minibatches` AdamW updates at learning_rate, each on a disjoint share of whole
  groups, split into micro_batches for memory. Trajectories are packed into rows of seq_len
  tokens (prompt + completion must fit), the row count padded to a multiple of row_multiple
  (fewer shapes, fewer compiles).

  weight_sync_every: the engine gets the trainer's weights after every n-th step only
  (slime's --update-weights-interval); in between it generates on the weights it has, so
  step t's rollouts are t mod n versions old, a staleness fixed by the schedule, not by
  timing (rollouts ahead of the trainer, rl.sources.Ahead). A resumed run restarts the cycle
  at its checkpoint's step; evaluations then run on an engine of their own with the current
  weights.

  deterministic: a reproducible run, which the same command repeats bit for bit (every
  metrics.jsonl field but timings, every array of every checkpoint) on the same hardware and
  software (scripts/check_determinism.py checks one): rl.trainer.make_deterministic() first
  (XLA's deterministic GPU operations, deterministic batching in the servers the run
  starts), and nothing that depends on timing (rollouts Ahead of the trainer, Partial
  rollouts paused by aborting requests: refused by rl.sources). Everything else already is:
  sampling is seeded (the embedded engine from each step's seed, servers from a
  sampling_seed per request: start SGLang with --enable-deterministic-inference, or it
  ignores them), and the loop reduces on the host in trajectory order, whatever order
  completions arrive in.

  hybrid: trainer and engine take turns with the accelerators' memory (Kimi k1.5's hybrid
  deployment): the train state waits in pinned host memory while the engine generates, and
  after generating the engine releases its weights and KV cache until the step's weight
  update (Capabilities.release_memory; SGLang servers started with --enable-memory-saver).
  Lockstep rollouts only (rollouts Ahead of the trainer generate while it trains), with
  weight_sync_every 1 (the engine's weights come back with the new ones). Each step's
  metrics have the switch seconds (rl.loop.rl_steps). On GPUs, JAX must give freed memory
  back to the device for the engine to use it: BUILD.md, "Hybrid deployment".

  freeze_vision: a vision-language model's tower (params["visual"], the patch merger
  included) keeps its starting weights through RL; False trains it with the decoder.

  lora: train LoRA adapters (models/lora.py) over the starting params, which stay frozen and
  are the reference policy; the optimizer state and checkpoints hold the adapters alone, and
  the engine gets the merged weights. "LoRA Without Regret" puts the best learning rate at
  about 10x full fine-tuning's.
  """
  num_steps: int = 100
  prompts_per_step: int = 32
  samples_per_prompt: int = 8
  max_new_tokens: int = 48
  temperature: float = 1.0
  top_p: float = 1.0
  learning_rate: float = 1e-4
  minibatches: int = 1
  micro_batches: int = 1
  seq_len: int = 128
  row_multiple: int = 8
  weight_sync_every: int = 1
  deterministic: bool = False
  hybrid: bool = False
  freeze_vision: bool = False
  lora: Optional[LoraConfig] = None

  def check(self) -> None:
    """ConfigError for sizes that cannot run (rl.trainer.build calls it before anything is
    built)."""
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "micro_batches",
                 "seq_len", "row_multiple"):
      if getattr(self, name) < 1:
        raise ConfigError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
    if not 1 <= self.minibatches <= self.prompts_per_step:
      raise ConfigError(f"RLConfig.minibatches={self.minibatches} must be in [1, "
                        f"prompts_per_step={self.prompts_per_step}]")
    if self.weight_sync_every < 1:
      raise ConfigError(f"RLConfig.weight_sync_every={self.weight_sync_every} must be >= 1 (1: "
                        "after every step)")
    if self.num_steps < 0:
      raise ConfigError(f"RLConfig.num_steps={self.num_steps} must be >= 0")


@dataclasses.dataclass(frozen=True)
class KLReward:
  """KL to the reference in the reward (PPO / InstructGPT style; verl's use_kl_in_reward):
  r_i -= coef * sum_t kl(engine_logp_t, ref_logp_t), kl one of rl.kl.ESTIMATORS, applied
  after the reward transforms, to every trajectory a step trains on."""
  coef: float = 0.0
  estimator: str = "k1"

  def check(self) -> None:
    if self.estimator not in kl.ESTIMATORS:
      raise ConfigError(f"unknown KLReward.estimator {self.estimator!r}; valid: "
                        f"{sorted(kl.ESTIMATORS)}")
