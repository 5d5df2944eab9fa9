"""Off-policy corrections: batch transforms for tokens an older policy generated.

A step trains on tokens that weights older than its own may have generated: partial
rollouts resumed across steps, rollouts made ahead of the trainer, weights synced every n
steps, or simply an engine whose numerics differ from the trainer's. A correction rewrites
each packed minibatch before its update, given the step (the version of the weights being
trained) and, when it asks for them, the trainer's own log-probs of the batch's targets under
the step's starting params (one forward pass per minibatch, before the first update):

    correction.apply(batch, step=..., trainer_logp=f32[rows, seq] | None) -> (batch, metrics)

Owns the corrections, their metrics (engine_logp_diff_mean / _max: |trainer - engine| over
loss tokens; trust_region_masked) and the registry. It does not own when they run (the loop:
rl/loop.py) or the loss (rl/losses.py), which reads the rewritten old_logp, advantages and
loss_mask like any other batch.

Adding a correction: a function returning a `Correction`, plus an entry in CORRECTIONS.
"""

import dataclasses
from typing import Callable

import numpy as np

from rl import ConfigError
from rl.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class Correction:
  """name: how metrics and errors call it; reads: optional TrainBatch fields it reads (the
  loop fills them); trainer_logp: whether it needs the trainer's log-probs; apply: the
  transform."""
  name: str
  apply: Callable[..., tuple[TrainBatch, dict[str, float]]]
  reads: frozenset[str] = frozenset()
  trainer_logp: bool = False


def keep() -> Correction:
  """Train on every token as generated: the loss's ratio uses the engine's log-probs."""
  return Correction("keep", lambda batch, *, step, trainer_logp: (batch, {}))


def mask_stale() -> Correction:
  """Tokens an older policy than the step's generated (version < step) leave the loss."""

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del trainer_logp
    fresh = np.asarray(batch.versions) >= step
    return batch.replace(loss_mask=np.where(fresh, batch.loss_mask, 0.0).astype(np.float32)), {}
  return Correction("mask", apply, reads=frozenset({"versions"}))


def _mismatch(batch: TrainBatch, trainer_logp) -> tuple[np.ndarray, np.ndarray, dict]:
  """(loss-token mask, trainer - engine log-ratio on it, its mean and max |.|)."""
  mask = np.asarray(batch.loss_mask) > 0
  diff = (np.asarray(trainer_logp) - np.asarray(batch.old_logp)) * mask
  return mask, diff, {"engine_logp_diff_mean": float(np.abs(diff).sum() / max(mask.sum(), 1)),
                      "engine_logp_diff_max": float(np.abs(diff).max())}


def tis(*, cap: float = 2.0) -> Correction:
  """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): old_logp := the trainer's log-probs, and each token's
  advantage times min(pi_trainer / pi_engine, cap)."""
  if not cap > 0:
    raise ConfigError(f"tis: cap={cap} must be > 0")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    trainer_logp = np.asarray(trainer_logp)
    mask, diff, metrics = _mismatch(batch, trainer_logp)
    weight = np.where(mask, np.minimum(np.exp(np.clip(diff, -20.0, 20.0)), cap), 1.0)
    return batch.replace(old_logp=trainer_logp.astype(np.float32),
                         advantages=(np.asarray(batch.advantages) * weight).astype(np.float32)
                         ), metrics
  return Correction("tis", apply, trainer_logp=True)


def trust_region(*, low: float = -1.0, high: float = 1.0) -> Correction:
  """Kimi K3's local neighbourhood of the current policy: the tokens whose log-ratio
  d = trainer - engine (old) log-prob lies outside [low, high] leave the loss (loss_mask 0);
  the others keep the engine's old_logp, as `keep`."""
  if not low < 0 < high:
    raise ConfigError(f"trust_region: (low, high) = ({low}, {high}) must be a window of "
                      "log-ratios around the current policy, low < 0 < high, e.g. (-1.0, 1.0)")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    mask, diff, metrics = _mismatch(batch, trainer_logp)
    outside = mask & ((diff < low) | (diff > high))
    metrics["trust_region_masked"] = float(outside.sum() / max(mask.sum(), 1))
    return batch.replace(loss_mask=np.where(outside, 0.0, batch.loss_mask).astype(np.float32)
                         ), metrics
  return Correction("trust_region", apply, trainer_logp=True)


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "keep": keep, "mask": mask_stale, "tis": tis, "trust_region": trust_region}


def combine(metrics: list[dict[str, float]]) -> dict[str, float]:
  """One step's correction metrics from its minibatches': the largest of each *_max, the mean
  of the others."""
  keys = metrics[0] if metrics else {}
  return {k: float(max(m[k] for m in metrics)) if k.endswith("_max")
          else float(np.mean([m[k] for m in metrics])) for k in keys}
