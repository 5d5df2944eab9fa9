"""Intervals over seeds and the verdicts read off them: pure functions of numbers.

A metric measured once per seed gets a mean and a confidence interval (Student t, or a
percentile bootstrap); two arms run on the same seeds are compared through the per-seed
differences (a paired interval). A prediction names the direction the published result
expects of such a difference, and `verdict` reads it off the interval:

  reproduced        the interval excludes `against` (usually 0) in the predicted direction;
  not reproduced    it excludes it in the opposite direction, or it lies within +-margin of
                    it (any effect is smaller than the margin: a real null);
  too wide to tell  neither: the interval spans `against` and reaches past the margin;
  one seed: no interval   fewer than two seeds.

Owns no I/O, no plotting and nothing about runs; experiments/findings.py and
experiments/compare.py use it. numpy only: the t quantile comes from the closed-form Student
t distribution function for whole degrees of freedom (Abramowitz & Stegun 26.7.3-4).
"""

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

REPRODUCED = "reproduced"
PARTIAL = "partially reproduced"
NOT_REPRODUCED = "not reproduced"
TOO_WIDE = "too wide to tell"
ONE_SEED = "one seed: no interval"
VERDICTS = (REPRODUCED, PARTIAL, NOT_REPRODUCED, TOO_WIDE, ONE_SEED)
METHODS = ("t", "bootstrap")


def t_cdf(t: float, df: int) -> float:
  """P(T <= t) for Student's t with `df` (a whole number >= 1) degrees of freedom."""
  if df < 1 or int(df) != df:
    raise ValueError(f"t_cdf: df must be a whole number >= 1, got {df}")
  theta = math.atan2(t, math.sqrt(df))
  sin, cos = math.sin(theta), math.cos(theta)
  # A(t) = P(|T| <= |t|), signed with t; a finite series in cos(theta).
  if df % 2:
    term, total = cos, 0.0
    for j in range(1, (df - 1) // 2 + 1):
      total += term
      term *= cos * cos * (2 * j) / (2 * j + 1)
    a = 2 / math.pi * (theta + sin * total)
  else:
    term, total = 1.0, 0.0
    for j in range(1, df // 2 + 1):
      total += term
      term *= cos * cos * (2 * j - 1) / (2 * j)
    a = sin * total
  return 0.5 + 0.5 * a


def t_quantile(p: float, df: int) -> float:
  """The t with t_cdf(t, df) = p, by bisection (to about 1e-12)."""
  if not 0 < p < 1:
    raise ValueError(f"t_quantile: p must lie in (0, 1), got {p}")
  if p < 0.5:
    return -t_quantile(1 - p, df)
  low, high = 0.0, 1.0
  while t_cdf(high, df) < p:
    low, high = high, 2 * high
  for _ in range(200):
    mid = (low + high) / 2
    low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    if high - low < 1e-12 * max(1.0, high):
      break
  return (low + high) / 2


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of `n` per-seed values and its confidence interval [low, high] (NaN with
  fewer than two values)."""
  mean: float
  low: float
  high: float
  n: int
  level: float = 0.95
  method: str = "t"

  def __str__(self) -> str:
    if self.n < 2:
      return f"{self.mean:+.3f} (1 seed)"
    return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] ({self.n} seeds)"

  def as_dict(self) -> dict:
    """For JSON: the ends None rather than NaN with one seed."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in dataclasses.asdict(self).items()}


def mean_ci(values: Sequence[float], *, level: float = 0.95, method: str = "t",
            resamples: int = 10_000, seed: int = 0) -> Interval:
  """Mean and `level` confidence interval of `values` (one per seed).

  method "t": mean +- t_{(1+level)/2, n-1} * sd / sqrt(n) (sd with n - 1).
  method "bootstrap": percentiles of the means of `resamples` resamples with replacement
  (numpy Generator `seed`); with a handful of seeds it is narrower than the t interval.
  """
  if method not in METHODS:
    raise ValueError(f"mean_ci: method {method!r}; valid: {', '.join(METHODS)}")
  if not 0 < level < 1:
    raise ValueError(f"mean_ci: level must lie in (0, 1), got {level}")
  x = np.asarray(values, float)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"mean_ci: needs a non-empty list of numbers, got shape {x.shape}")
  mean, n = float(x.mean()), int(x.size)
  if n < 2:
    return Interval(mean, math.nan, math.nan, n, level, method)
  if method == "t":
    half = t_quantile((1 + level) / 2, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    low, high = mean - half, mean + half
  else:
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    low, high = (float(q) for q in np.quantile(means, [(1 - level) / 2, (1 + level) / 2]))
  return Interval(mean, low, high, n, level, method)


def paired_differences(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
  """{seed: a[seed] - b[seed]}: two arms compared on the same seeds."""
  if set(a) != set(b):
    raise ValueError(f"paired_differences: the arms ran on different seeds "
                     f"({sorted(a)} vs {sorted(b)}); run both on the same ones")
  return {seed: float(a[seed]) - float(b[seed]) for seed in sorted(a)}


@dataclasses.dataclass(frozen=True)
class Prediction:
  """What a published result predicts of a difference D: D > against (direction +1) or
  D < against (-1). Values of D within +-margin of `against` count as no effect.

  "A beats B": direction +1 on A - B, against 0, margin the smallest gap that matters.
  "X stays flat or falls" (a bound, not an effect): direction -1, against the largest rise
  that still counts as flat, margin 0.
  """
  direction: int
  margin: float = 0.0
  against: float = 0.0

  def __post_init__(self):
    if self.direction not in (1, -1):
      raise ValueError(f"Prediction.direction must be +1 or -1, got {self.direction}")
    if self.margin < 0:
      raise ValueError(f"Prediction.margin must be >= 0, got {self.margin}")

  def __str__(self) -> str:
    side = ">" if self.direction > 0 else "<"
    margin = f" (none within ±{self.margin:g})" if self.margin else ""
    return f"{side} {self.against:g}{margin}"


def verdict(interval: Interval, prediction: Prediction) -> str:
  """REPRODUCED, NOT_REPRODUCED, TOO_WIDE or ONE_SEED (see the module docstring)."""
  if interval.n < 2:
    return ONE_SEED
  # The interval of direction * (D - against): the prediction is then "above zero".
  ends = sorted(prediction.direction * (v - prediction.against)
                for v in (interval.low, interval.high))
  if ends[0] > 0:
    return REPRODUCED
  if ends[1] < 0 or (prediction.margin and -prediction.margin < ends[0]
                     and ends[1] < prediction.margin):
    return NOT_REPRODUCED
  return TOO_WIDE


def all_of(verdicts: Iterable[str]) -> str:
  """A claim made of parts that must all hold: reproduced if every part is, not reproduced
  if none is, partially if some are and the others are not; too wide to tell if any part is
  (the claim's verdict is then open), one seed if any part has no interval."""
  verdicts = list(verdicts)
  if ONE_SEED in verdicts:
    return ONE_SEED
  if TOO_WIDE in verdicts:
    return TOO_WIDE
  reproduced = [v in (REPRODUCED, PARTIAL) for v in verdicts]
  if all(v == REPRODUCED for v in verdicts):
    return REPRODUCED
  return PARTIAL if any(reproduced) else NOT_REPRODUCED


def either(verdicts: Iterable[str]) -> str:
  """A claim that holds if any one of its parts does: reproduced if one part is, not
  reproduced if every part is not, otherwise too wide to tell (or one seed)."""
  verdicts = list(verdicts)
  if ONE_SEED in verdicts:
    return ONE_SEED
  if REPRODUCED in verdicts:
    return REPRODUCED
  return NOT_REPRODUCED if all(v == NOT_REPRODUCED for v in verdicts) else TOO_WIDE
