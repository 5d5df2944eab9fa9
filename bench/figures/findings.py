"""docs/findings/report.md: written from each finding's results.json, so only what was written
into it by hand is registered: when the runs were made, and the reading of finding i."""

import json
import os

from experiments import findings_report

from .check import Figure, Generated
from .common import AHEAD, COMMANDS


def _findings_report(root: str) -> str:
  """docs/findings/report.md: each finding's results.json beside it, in the order of their
  letters (a, a2, b, ...), as experiments/findings.py writes it."""
  folder = os.path.join(root, "docs/findings")
  keys = sorted((key for key in os.listdir(folder)
                 if os.path.isfile(os.path.join(folder, key, "results.json"))),
                key=lambda key: key.split("_")[0])
  results = []
  for key in keys:
    with open(os.path.join(folder, key, "results.json")) as f:
      results.append(json.load(f))
  return findings_report.report(results)


def _hours(minutes_: int) -> str:
  """105 -> '1 h 45 min'."""
  return f"{minutes_ // 60} h {minutes_ % 60} min"


def _loss(difference: float) -> str:
  """-0.046 -> '0.046', for '0.046 less accurate'."""
  return f"{-difference:.3f}"


def _power(value: float) -> str:
  """1.36e-08 -> '1.4e-8'."""
  mantissa, exponent = f"{value:.1e}".split("e")
  return f"{mantissa}e{int(exponent)}"


def _int4_gap(arms: list[dict], column: str) -> float:
  """docs/findings/i_int4_rollouts: the float32 engine's mean over seeds of `column` less the
  uncorrected INT4 engine's (the table's first two rows)."""
  return arms[0][column]["mean"] - arms[1][column]["mean"]


def _int4_loss_before_rl(arms: list[dict]) -> str:
  """The accuracy the uncorrected INT4 engine has lost before RL, from rounding alone."""
  return f"{_int4_gap(arms, 'held-out acc. start'):.3f}"


def _int4_rl_cost(arms: list[dict]) -> str:
  """The accuracy the uncorrected INT4 engine loses by the end beyond what it lost before RL."""
  cost = _int4_gap(arms, "held-out acc., 2nd half") - _int4_gap(arms, "held-out acc. start")
  return f"{cost:.3f}"


GENERATED = (Generated("docs/findings/report.md", _findings_report),)

# Finding i's checks: 0 the uncorrected INT4 engine less the float32 one, then
# each correction less none: 1 token TIS, 2 sequence TIS, 3 MIS, 4 IcePop, 5 QAT; its arms
# (table rows): 0 the float32 engine, 1 the uncorrected INT4 one, ..., 6 QAT.
_INT4 = "docs/findings/i_int4_rollouts/results.json"
_KL = "KL(engine || trainer), k3"
FIGURES = (
    Figure("docs/findings/report.md", "runs of the morning ({} for the eleven findings then)",
           COMMANDS, ("findings_five_seeds/minutes",), _hours),
    Figure("docs/findings/report.md", "is real at this size: KL {} per token", _INT4,
           (f"table/1/{_KL}/mean",), "{:.3f}"),
    Figure("docs/findings/report.md", "the 1st percentile of the ratio at {}.", _INT4,
           ("table/1/ratio p01/mean",), "{:.2f}"),
    Figure("docs/findings/report.md", "QAT removes it: its KL ({}) is", _INT4,
           (f"table/6/{_KL}/mean",), _power),
    Figure("docs/findings/report.md", "serves a model {} less accurate than the float32", _INT4,
           ("checks/0/mean",), _loss),
    Figure("docs/findings/report.md", "(reproduced), but {} of that is there before", _INT4,
           ("table",), _int4_loss_before_rl),
    Figure("docs/findings/report.md", "the mismatch costs about {} beyond the rounding", _INT4,
           ("table",), _int4_rl_cost),
    Figure("docs/findings/report.md", "masked above) gains {}, whose interval", _INT4,
           ("checks/3/mean",), "{:+.3f}"),
    Figure("docs/findings/report.md", "Token TIS ({}) and QAT ({}) gain as much", _INT4,
           ("checks/1/mean", "checks/5/mean"), "{:+.3f}"),
    Figure("docs/findings/report.md", "Sequence TIS ({}) and IcePop ({}) lose accuracy", _INT4,
           ("checks/2/mean", "checks/4/mean"), "{:+.3f}"),
    # Finding i runs on the quickstart, whose answers' length docs/ahead measured.
    Figure("docs/findings/report.md", "the product over its ~{} tokens", AHEAD,
           ("runs/lockstep/completion_length/mean",), "{:.0f}"),
)

NOT_MEASURED = ()
