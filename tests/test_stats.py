"""experiments/stats.py: intervals over seeds against hand-computed cases, and the verdict
read off an interval."""

import math

import pytest

from experiments import stats
from experiments.stats import NOT_REPRODUCED, ONE_SEED, PARTIAL, REPRODUCED, TOO_WIDE


@pytest.mark.parametrize("p,df,expected", [  # printed t tables
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764), (0.975, 10, 2.2281),
    (0.975, 30, 2.0423), (0.95, 4, 2.1318), (0.995, 9, 3.2498), (0.5, 7, 0.0),
    (0.025, 4, -2.7764)])
def test_t_quantile_matches_the_tables(p, df, expected):
  assert stats.t_quantile(p, df) == pytest.approx(expected, abs=5e-5)
  assert stats.t_cdf(stats.t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)


def test_t_interval_by_hand():
  # mean 3, sd sqrt(2.5), t_{0.975,4} = 2.7764: 3 +- 2.7764 * sqrt(2.5 / 5) = 3 +- 1.9632
  interval = stats.mean_ci([1, 2, 3, 4, 5])
  assert interval.mean == 3 and interval.n == 5
  assert interval.low == pytest.approx(3 - 1.9632, abs=1e-4)
  assert interval.high == pytest.approx(3 + 1.9632, abs=1e-4)
  assert str(interval) == "+3.000 [+1.037, +4.963] (5 seeds)"
  ninety = stats.mean_ci([1, 2, 3, 4, 5], level=0.9)  # t_{0.95,4} = 2.1318
  assert ninety.high == pytest.approx(3 + 2.1318 * math.sqrt(0.5), abs=1e-4)


def test_bootstrap_interval_is_seeded_and_inside_the_range():
  a = stats.mean_ci([1, 2, 3, 4, 5], method="bootstrap", seed=1)
  assert a == stats.mean_ci([1, 2, 3, 4, 5], method="bootstrap", seed=1)
  assert 1 <= a.low < 3 < a.high <= 5
  t = stats.mean_ci([1, 2, 3, 4, 5])
  assert t.low < a.low and a.high < t.high  # with five seeds the bootstrap is narrower


def test_one_value_has_no_interval():
  interval = stats.mean_ci([0.7])
  assert interval.mean == 0.7 and math.isnan(interval.low) and interval.as_dict()["low"] is None
  assert stats.verdict(interval, stats.Prediction(+1)) == ONE_SEED


def test_bad_inputs_are_refused():
  with pytest.raises(ValueError, match="method 'z'"):
    stats.mean_ci([1, 2], method="z")
  with pytest.raises(ValueError, match="non-empty"):
    stats.mean_ci([])
  with pytest.raises(ValueError, match="different seeds"):
    stats.paired_differences({0: 1.0, 1: 2.0}, {0: 1.0})
  with pytest.raises(ValueError, match="direction"):
    stats.Prediction(0)


def test_paired_differences_by_seed():
  assert stats.paired_differences({1: 3.0, 0: 2.0}, {0: 1.5, 1: 1.0}) == {0: 0.5, 1: 2.0}


def _ci(low, high):
  return stats.Interval((low + high) / 2, low, high, 5)


@pytest.mark.parametrize("low,high,prediction,expected", [
    (0.01, 0.2, stats.Prediction(+1, 0.03), REPRODUCED),  # excludes 0 upwards
    (-0.2, -0.01, stats.Prediction(+1, 0.03), NOT_REPRODUCED),  # excludes it the other way
    (-0.02, 0.025, stats.Prediction(+1, 0.03), NOT_REPRODUCED),  # within the margin: none
    (-0.02, 0.05, stats.Prediction(+1, 0.03), TOO_WIDE),  # spans 0, reaches past the margin
    (-0.02, 0.025, stats.Prediction(+1), TOO_WIDE),  # no margin: never a null
    (-3.0, -1.0, stats.Prediction(-1, 1.0), REPRODUCED),
    (1.0, 3.0, stats.Prediction(-1, 1.0), NOT_REPRODUCED),
    # "flat or falls": below +0.02
    (-0.1, 0.01, stats.Prediction(-1, against=0.02), REPRODUCED),
    (0.03, 0.1, stats.Prediction(-1, against=0.02), NOT_REPRODUCED),
    (-0.1, 0.05, stats.Prediction(-1, against=0.02), TOO_WIDE),
    # "falls by under 0.05": above -0.05
    (-0.04, 0.02, stats.Prediction(+1, against=-0.05), REPRODUCED),
])
def test_verdict_reads_the_interval(low, high, prediction, expected):
  assert stats.verdict(_ci(low, high), prediction) == expected


def test_verdicts_combine():
  assert stats.all_of([REPRODUCED, REPRODUCED]) == REPRODUCED
  assert stats.all_of([REPRODUCED, NOT_REPRODUCED]) == PARTIAL
  assert stats.all_of([NOT_REPRODUCED, NOT_REPRODUCED]) == NOT_REPRODUCED
  assert stats.all_of([REPRODUCED, TOO_WIDE]) == TOO_WIDE  # open: reproduced or partially
  assert stats.all_of([NOT_REPRODUCED, TOO_WIDE]) == TOO_WIDE
  assert stats.all_of([ONE_SEED, REPRODUCED]) == ONE_SEED
  assert stats.either([NOT_REPRODUCED, REPRODUCED]) == REPRODUCED
  assert stats.either([NOT_REPRODUCED, TOO_WIDE]) == TOO_WIDE
  assert stats.either([NOT_REPRODUCED, NOT_REPRODUCED]) == NOT_REPRODUCED
