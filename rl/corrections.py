"""Off-policy corrections: batch transforms for tokens an older policy generated.

A step trains on tokens that weights older than its own may have generated: partial
rollouts resumed across steps, rollouts made ahead of the trainer, weights synced every n
steps, or simply an engine whose numerics differ from the trainer's. A correction rewrites
each packed minibatch before its update, given the step (the version of the weights being
trained) and, when it asks for them, the trainer's own log-probs of the batch's targets under
the step's starting params (one forward pass per minibatch, before the first update):

    correction.apply(batch, step=..., trainer_logp=f32[rows, seq] | None) -> (batch, metrics)

Owns the corrections, the share of loss tokens each masking one drops, the registry, and
`measure`: what the loop logs of every minibatch whatever the correction (the mismatch,
`_mismatch`: |trainer - engine| log-prob mean and max over loss tokens, KL(engine || trainer)
estimates, ratio percentiles; and the share each masking correction would drop). The menu:
keep (the default; with `measure`, the metrics-only mode), mask (stale versions), tis and
seq_tis (truncated importance weights per token or per trajectory), mis and icepop (masked
importance weights), trust_region (K2.5 / K3's token mask), geo_mask (the geometric-mean
sequence mask). It does not own when they run (the loop:
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


def _log_ratios(batch: TrainBatch, trainer_logp) -> tuple[np.ndarray, np.ndarray]:
  """(loss-token mask bool[rows, seq], d = trainer - engine log-ratio on it, 0 elsewhere)."""
  mask = np.asarray(batch.loss_mask) > 0
  return mask, (np.asarray(trainer_logp) - np.asarray(batch.old_logp)) * mask


def _mismatch(mask, diff) -> dict[str, float]:
  """The mismatch metrics of the log-ratios `diff` on `mask` (`_log_ratios`): mean and max
  |d|; KL(engine || trainer) per token estimated on the engine's samples, k1 = mean(-d) and
  k3 = mean(exp(d) - 1 - d) (Schulman's estimators, k3 >= 0); and the 1st and 99th
  percentiles of the token ratio exp(d)."""
  count = max(mask.sum(), 1)
  d = np.clip(diff[mask], -20.0, 20.0) if mask.any() else np.zeros(1)
  return {"engine_logp_diff_mean": float(np.abs(diff).sum() / count),
          "engine_logp_diff_max": float(np.abs(diff).max()),
          "engine_kl_k1": float(-d.sum() / count),
          "engine_kl_k3": float((np.exp(d) - 1.0 - d).sum() / count),
          "engine_ratio_p01": float(np.exp(np.percentile(d, 1))),
          "engine_ratio_p99": float(np.exp(np.percentile(d, 99)))}


def _share(dropped, mask) -> float:
  """The share of `mask`'s tokens in `dropped`."""
  return float(dropped.sum() / max(mask.sum(), 1))


def _per_sequence(batch: TrainBatch, values, mask) -> tuple[np.ndarray, np.ndarray]:
  """(sum of `values` over each token's trajectory's loss tokens, that trajectory's count of
  loss tokens), both f64[rows, seq]. A trajectory is a (row, segment id) pair."""
  seg = np.asarray(batch.segment_ids)
  key = (np.arange(seg.shape[0])[:, None] * (int(seg.max()) + 1) + seg).ravel()
  sums = np.bincount(key, weights=np.where(mask, values, 0.0).ravel())
  counts = np.bincount(key, weights=mask.ravel().astype(np.float64))
  return sums[key].reshape(seg.shape), counts[key].reshape(seg.shape)


def _log_ratio(batch: TrainBatch, mask, diff, level: str):
  """The log importance ratio each loss token is judged by: its own (level "token") or its
  trajectory's, the sum of its tokens' (level "sequence")."""
  if level == "token":
    return diff
  return _per_sequence(batch, diff, mask)[0]


def _reweighted(batch: TrainBatch, trainer_logp, mask, weight, dropped) -> TrainBatch:
  """old_logp := the trainer's; loss tokens' advantages times `weight`; `dropped` tokens leave
  the loss."""
  return batch.replace(
      old_logp=np.asarray(trainer_logp, np.float32),
      advantages=(np.asarray(batch.advantages) * np.where(mask, weight, 1.0)).astype(np.float32),
      loss_mask=np.where(dropped, 0.0, batch.loss_mask).astype(np.float32))


def tis(*, cap: float = 2.0) -> Correction:
  """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): old_logp := the trainer's log-probs, and each token's
  advantage times min(pi_trainer / pi_engine, cap)."""
  if not cap > 0:
    raise ConfigError(f"tis: cap={cap} must be > 0")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    trainer_logp = np.asarray(trainer_logp)
    mask, diff = _log_ratios(batch, trainer_logp)
    weight = np.where(mask, np.minimum(np.exp(np.clip(diff, -20.0, 20.0)), cap), 1.0)
    return batch.replace(old_logp=trainer_logp.astype(np.float32),
                         advantages=(np.asarray(batch.advantages) * weight).astype(np.float32)
                         ), {}
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
    mask, diff = _log_ratios(batch, trainer_logp)
    outside = mask & ((diff < low) | (diff > high))
    return batch.replace(loss_mask=np.where(outside, 0.0, batch.loss_mask).astype(np.float32)
                         ), {"trust_region_masked": _share(outside, mask)}
  return Correction("trust_region", apply, trainer_logp=True)


def seq_tis(*, cap: float = 2.0) -> Correction:
  """Sequence-level truncated importance sampling: as `tis`, with one weight per trajectory,
  min(prod_t pi_trainer / pi_engine, cap) over its loss tokens, on all of them (unbiased for a
  sequence-level objective, at a higher variance than the token-level weight)."""
  if not cap > 0:
    raise ConfigError(f"seq_tis: cap={cap} must be > 0")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    mask, diff = _log_ratios(batch, trainer_logp)
    weight = np.minimum(np.exp(np.clip(_log_ratio(batch, mask, diff, "sequence"), -20.0, 20.0)),
                        cap)
    return _reweighted(batch, trainer_logp, mask, weight, np.zeros_like(mask)), {}
  return Correction("seq_tis", apply, trainer_logp=True)


def mis(*, low: float = 0.0, high: float = 2.0, level: str = "token") -> Correction:
  """Masked importance sampling: the ratio pi_trainer / pi_engine of each token (level
  "token") or of each trajectory (level "sequence", the product over its loss tokens) weights
  the advantages where it lies in [low, high]; tokens or whole trajectories outside leave the
  loss, where `tis` would cap them. old_logp := the trainer's log-probs."""
  if level not in ("token", "sequence"):
    raise ConfigError(f"mis: level={level!r} must be 'token' or 'sequence'")
  return _masked_importance("mis" if level == "token" else "seq_mis", low, high, level)


def icepop(*, low: float = 0.5, high: float = 5.0) -> Correction:
  """IcePop (Ring-1T, arXiv:2510.18855): a two-sided token mask, each token's ratio
  pi_trainer / pi_engine weighting its advantage inside [low, high] and the token leaving the
  loss outside; token-level `mis` with a lower bound above 0."""
  return _masked_importance("icepop", low, high, "token")


def _masked_importance(name: str, low: float, high: float, level: str) -> Correction:
  if not 0.0 <= low < 1.0 < high:
    raise ConfigError(f"{name}: [low, high] = [{low}, {high}] must hold ratio 1: 0 <= low < 1 "
                      "< high")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    mask, diff = _log_ratios(batch, trainer_logp)
    ratio = np.exp(np.clip(_log_ratio(batch, mask, diff, level), -20.0, 20.0))
    outside = mask & ((ratio < low) | (ratio > high))
    return (_reweighted(batch, trainer_logp, mask, ratio, outside),
            {f"{name}_masked": _share(outside, mask)})
  return Correction(name, apply, trainer_logp=True)


def geo_mask(*, low: float = 0.9, high: float = 1.1) -> Correction:
  """The geometric-mean sequence mask: trajectories whose per-token geometric-mean ratio
  exp(mean_t (log pi_trainer - log pi_engine)) lies outside [low, high] leave the loss whole,
  the others train as generated (old_logp stays the engine's, as `keep`). Unlike the product
  of `seq_tis`, the mean does not grow with the length, so long and short trajectories are
  judged alike."""
  if not 0.0 < low < 1.0 < high:
    raise ConfigError(f"geo_mask: [low, high] = [{low}, {high}] must hold ratio 1: 0 < low < "
                      "1 < high")

  def apply(batch: TrainBatch, *, step: int, trainer_logp):
    del step
    mask, diff = _log_ratios(batch, trainer_logp)
    sums, counts = _per_sequence(batch, diff, mask)
    mean = np.exp(np.clip(sums / np.maximum(counts, 1.0), -20.0, 20.0))
    outside = mask & ((mean < low) | (mean > high))
    return batch.replace(loss_mask=np.where(outside, 0.0, batch.loss_mask).astype(np.float32)
                         ), {"geo_mask_masked": _share(outside, mask)}
  return Correction("geo_mask", apply, trainer_logp=True)


def measure(batch: TrainBatch, trainer_logp) -> dict[str, float]:
  """What the loop logs of every minibatch whatever the correction (before it runs): the
  mismatch (`_mismatch`'s figures) and the share of loss tokens each masking correction would
  drop at its defaults (`would_mask_<name>`), so a run sees what a correction would do before
  using one. With `keep` (the default) this is the metrics-only mode."""
  metrics = _mismatch(*_log_ratios(batch, trainer_logp))
  was = np.asarray(batch.loss_mask) > 0
  for correction in _WOULD_MASK:
    corrected, _ = correction.apply(batch, step=0, trainer_logp=trainer_logp)
    dropped = was & ~(np.asarray(corrected.loss_mask) > 0)
    metrics[f"would_mask_{correction.name}"] = _share(dropped, was)
  return metrics


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "keep": keep, "mask": mask_stale, "tis": tis, "trust_region": trust_region,
    "seq_tis": seq_tis, "mis": mis, "icepop": icepop, "geo_mask": geo_mask}
# The masking corrections at their defaults, whose shares `measure` logs.
_WOULD_MASK = (trust_region(), mis(), icepop(), geo_mask(), mis(level="sequence"))


def combine(metrics: list[dict[str, float]]) -> dict[str, float]:
  """One step's correction metrics from its minibatches': the largest of each *_max, the mean
  of the others."""
  keys = metrics[0] if metrics else {}
  return {k: float(max(m[k] for m in metrics)) if k.endswith("_max")
          else float(np.mean([m[k] for m in metrics])) for k in keys}
