"""docs/distillation/README.md: on-policy distillation of two experts, from
docs/distillation/results.json (experiments/distill_demo.py), then three tries at reasoning
effort: the first from docs/effort/first_try.json, the second and third from
docs/effort/second_try.json (experiments/effort_demo.py, one entry a variant)."""

from typing import Any, Callable

from .check import Figure, NotMeasured
from .common import DISTILL, EFFORT, INTERVAL

_DOC = "docs/distillation/README.md"
_FIRST = "docs/effort/first_try.json"
_LEVELS = ("low", "high", "max")
_SECOND = ("filler", "shortcut", "shortcut_penalty")
_THIRD = ("conditioned", "conditioned_own", "conditioned_own_penalty")
_PENALTY = _THIRD[2]
_BASELINE = "baseline_sft_on_expert_samples"
_Format = str | Callable[[Any], str]


def _cells(*parts: tuple[tuple[str, ...], _Format]
           ) -> tuple[tuple[str, ...], tuple[_Format, ...]]:
  """A row's keys and formats, from (keys, one format for them all) parts in its order."""
  return (tuple(key for keys, _ in parts for key in keys),
          tuple(fmt for keys, fmt in parts for _ in keys))


def _number(value: float) -> str:
  """4.1875 -> '4.2', 19.0 -> '19', -1.0 -> '-1': to one decimal, no trailing zero."""
  return f"{value:.1f}".removesuffix(".0")


def _numbers(values: list[float]) -> str:
  """[0.5, 1.0, 1.5] -> '0.5 / 1 / 1.5'."""
  return " / ".join(map(_number, values))


def _range(values: list[float], fmt: str) -> str:
  """'0.15-0.16', or one figure where both ends read the same."""
  low, high = fmt.format(min(values)), fmt.format(max(values))
  return low if low == high else f"{low}-{high}"


def _seconds(stage: str, variants: tuple[str, ...]) -> Callable[[dict], str]:
  """The range over `variants` of the seconds `stage` took (seed 0), whole: '45-86'. A variant
  that reused another's stage took none."""
  def span(all_variants: dict) -> str:
    taken = [all_variants[v]["seconds"][stage] for v in variants]
    return _range([t for t in taken if not isinstance(t, str)], "{:.0f}")
  return span


def _student_over(model: str, domain: str) -> Callable[[dict], str]:
  """The student's accuracy on `domain` less `model`'s, signed: '+0.012'."""
  def difference(accuracy: dict) -> str:
    return f"{accuracy['student'][domain] - accuracy[model][domain]:+.3f}"
  return difference


def _student_short_of(model: str, domain: str) -> Callable[[dict], str]:
  """How far the student's accuracy on `domain` falls short of `model`'s: '0.035'."""
  def difference(accuracy: dict) -> str:
    return f"{accuracy[model][domain] - accuracy['student'][domain]:.3f}"
  return difference


def _accuracy_range(by_level: dict) -> str:
  """A stage's sampled accuracy over the levels: '0.20-0.25'."""
  return _range([level["accuracy"] for level in by_level.values()], "{:.2f}")


def _first_try_accuracy(budgets: tuple[str, ...]) -> Callable[[dict], str]:
  """The first try's sampled accuracy over every level at `budgets` (tokens)."""
  def span(by_level: dict) -> str:
    return _range([level["budgets"][b]["accuracy"] for level in by_level.values()
                   for b in budgets], "{:.2f}")
  return span


def _standard_error(records: int) -> str:
  """The largest standard error of one evaluation's accuracy (at 0.5) over `records`."""
  return f"{(0.25 / records) ** 0.5:.2f}"


def _levels(variant: str, field: str, stages: tuple[str, ...] = ("rl",)) -> tuple[str, ...]:
  """`field` at each level, and at each level each of `stages` (sft -> rl)."""
  return tuple(f"variants/{variant}/by_level/{stage}/{level}/{field}"
               for level in _LEVELS for stage in stages)


def _budgets(variant: str) -> tuple[str, ...]:
  return tuple(f"variants/{variant}/budgets/{level}/median" for level in _LEVELS)


def _greedy(variant: str) -> tuple[str, ...]:
  return (f"variants/{variant}/greedy_accuracy_after_sft",
          f"variants/{variant}/greedy_accuracy_after_rl")


def _design(variant: str, *fields: str) -> tuple[str, ...]:
  return tuple(f"variants/{variant}/design/{field}" for field in fields)


def _second_try(variant: str, quote: str, design: tuple[str, ...],
                design_fmts: tuple[_Format, ...]) -> Figure:
  """A row of the second try's table: `quote` is its first column, with `design`'s slots."""
  keys, fmts = _cells((_budgets(variant), _number), (_greedy(variant), "{:.3f}"),
                      (_levels(variant, "accuracy"), "{:.2f}"),
                      (_levels(variant, "mean_length"), "{:.1f}"),
                      (_levels(variant, "mean_length", ("sft",)), "{:.1f}"))
  return Figure(_DOC, f"| {quote} | {{}} / {{}} / {{}} | {{}} -> {{}} | {{}} / {{}} / {{}} | "
                "{} / {} / {} ({} / {} / {}) |", EFFORT, design + keys, design_fmts + fmts)


def _third_try(variant: str, quote: str, design: tuple[str, ...],
               design_fmts: tuple[_Format, ...]) -> Figure:
  """A row of the third try's table: per level, SFT -> RL."""
  keys, fmts = _cells((_budgets(variant), _number), (_greedy(variant), "{:.3f}"),
                      (_levels(variant, "accuracy", ("sft", "rl")), "{:.2f}"),
                      (_levels(variant, "mean_length", ("sft", "rl")), "{:.1f}"))
  return Figure(_DOC, f"| {quote} | {{}} / {{}} / {{}} | {{}} -> {{}} | "
                "{} -> {} / {} -> {} / {} -> {} | {} -> {} / {} -> {} / {} -> {} |", EFFORT,
                design + keys, design_fmts + fmts)


def _over_seeds(level: str, field: str) -> str:
  return f"variants/{_PENALTY}/rl_over_seeds/{level}/{field}"


def _length_interval(cell: dict) -> str:
  """experiments/stats.py's mean and interval of a length: '4.36 [4.25, 4.47]'."""
  return f"{cell['mean']:.2f} [{cell['low']:.2f}, {cell['high']:.2f}]"


def _accuracy_interval(cell: dict) -> str:
  """The same of an accuracy: '0.065 [0.032, 0.098]'."""
  return f"{cell['mean']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"


_SFT = "variants/conditioned/by_level/sft/{}/{}"
_RL = f"variants/{_PENALTY}/by_level/rl/{{}}/{{}}"
FIGURES = (
    # On-policy distillation
    Figure(_DOC, "experiments/distill_demo.py # ~{} minutes", DISTILL, ("minutes",), "{:.0f}"),
    Figure(_DOC, "final carry in {} of the problems", DISTILL, ("domains/add2/sloppy",),
           "{:.0%}"),
    Figure(_DOC, "as many completion tokens as the student generated ({})", DISTILL,
           ("student_tokens",), "{:,}"),
    Figure(_DOC, "one evaluation's standard error is about {})", DISTILL,
           ("eval_records_per_domain",), _standard_error),
    *(Figure(_DOC, f"| {row} | {{}} | {{}} |", DISTILL,
             (f"accuracy/{model}/add2", f"accuracy/{model}/add3"), fmt)
      for row, model, fmt in (
          ("SFT warm start", "sft", "{:.3f}"),
          ("expert add2", "expert_add2", ("**{:.3f}**", "{:.3f}")),
          ("expert add3", "expert_add3", ("{:.3f}", "**{:.3f}**")),
          ("student (opd, 60 steps)", "student", "{:.3f}"),
          ("SFT on expert samples (same tokens)", _BASELINE, "{:.3f}"))),
    Figure(_DOC, "matches the add2 expert on add2 ({}) and comes within {} of", DISTILL,
           ("accuracy", "accuracy"),
           (_student_over("expert_add2", "add2"), _student_short_of("expert_add3", "add3"))),
    Figure(_DOC, "student tokens on add3 ({}, between two and three standard errors of one "
           "evaluation) and ties it on add2 ({})", DISTILL, ("accuracy", "accuracy"),
           (_student_over(_BASELINE, "add3"), _student_over(_BASELINE, "add2"))),
    Figure(_DOC, "The add3 expert also lifts add2 ({})", DISTILL,
           ("accuracy/expert_add3/add2",), "{:.3f}"),
    # The first try
    Figure(_DOC, "greedy accuracy fell from {} after SFT to {} after {} RL steps", _FIRST,
           ("greedy_accuracy_after_sft", "greedy_accuracy_after_rl", "rl_steps"),
           ("{:.3f}", "{:.3f}", "{}")),
    Figure(_DOC, "mean sampled lengths of {} (low), {} (high) and {} (max) tokens", _FIRST,
           tuple(f"by_level/{level}/mean_length" for level in _LEVELS), "{:.1f}"),
    Figure(_DOC, "accuracy of {} at every budget from 24 tokens up ({} at 16)", _FIRST,
           ("by_level", "by_level"),
           (_first_try_accuracy(("24", "32", "48", "72")), _first_try_accuracy(("16",)))),
    # The second try
    Figure(_DOC, "the budget multiplier holds at {} for {} steps, then falls to {} over {}",
           EFFORT, _design("filler", *(f"schedule/{field}" for field in
                                       ("loose", "hold", "tight", "tighten_steps"))),
           (_number, "{}", _number, "{}")),
    Figure(_DOC, "(SFT warm start {} s, budgets {} s, RL {} s, per-level evaluation {} s",
           EFFORT, ("variants",) * 4,
           tuple(_seconds(stage, _SECOND) for stage in ("sft", "estimate_budgets", "rl", "eval"))),
    _second_try("filler", '`filler`: 0..{} "hmm;" steps, {} x median, over budget -> {}',
                _design("filler", "filler", "multipliers", "over_reward"),
                ("{}", _numbers, _number)),
    _second_try("shortcut", "`shortcut`: {} bare-answer demos, {} x upper quartile, -> {}",
                _design("shortcut", "direct", "multipliers", "over_reward"),
                ("{:.0%}", _numbers, _number)),
    _second_try("shortcut_penalty", "`shortcut_penalty`: the same, over budget -> {}",
                _design("shortcut_penalty", "over_reward"), (_number,)),
    Figure(_DOC, "(`filler`: {} after SFT, {} after RL; `shortcut`: {} -> {})", EFFORT,
           ("variants/filler/by_level/sft", "variants/filler/by_level/rl",
            "variants/shortcut/by_level/sft", "variants/shortcut/by_level/rl"),
           _accuracy_range),
    Figure(_DOC, "filler-heavy answers ({} tokens)", EFFORT,
           ("variants/filler/greedy_length_after_sft",), "{:.1f}"),
    # The third try
    Figure(_DOC, 'give the bare answer ("#106") to {} of the records at low, {} at high and {} '
           "at max", EFFORT, tuple(f"variants/conditioned/design/direct/{i}" for i in range(3)),
           "{:.0%}"),
    _third_try("conditioned", "`conditioned`: {} x upper quartile, over budget -> {}",
               _design("conditioned", "multipliers", "over_reward"), (_numbers, _number)),
    _third_try("conditioned_own", "`conditioned_own`: each level's own upper quartile, {}, -> {}",
               _design("conditioned_own", "multipliers", "over_reward"), (_numbers, _number)),
    _third_try(_PENALTY, f"`{_PENALTY}`: the same, over budget -> {{}}",
               _design(_PENALTY, "over_reward"), (_number,)),
    Figure(_DOC, "warm start {} s, budgets {} s, RL {} s, evaluation {} s.", EFFORT,
           ("variants",) * 4,
           tuple(_seconds(stage, _THIRD) for stage in ("sft", "estimate_budgets", "rl", "eval"))),
    Figure(_DOC, "by itself: {} / {} / {} tokens at {} / {} / {} accuracy", EFFORT,
           tuple(_SFT.format(level, "mean_length") for level in _LEVELS)
           + tuple(_SFT.format(level, "accuracy") for level in _LEVELS),
           ("{:.1f}",) * 3 + ("{:.2f}",) * 3),
    Figure(_DOC, "put low's median budget ({} tokens)", EFFORT,
           ("variants/conditioned/budgets/low/median",), _number),
    Figure(_DOC, "toward the column steps ({} -> {} tokens)", EFFORT,
           (_SFT.format("low", "mean_length"), "variants/conditioned/by_level/rl/low/mean_length"),
           "{:.1f}"),
    Figure(_DOC, "low turns into high ({} tokens, accuracy {})", EFFORT,
           ("variants/conditioned_own/by_level/rl/low/mean_length",
            "variants/conditioned_own/by_level/rl/low/accuracy"), ("{:.1f}", "{:.2f}")),
    Figure(_DOC, "low drops its column steps ({} -> {} tokens, nearly all bare answers, "
           "accuracy {})", EFFORT,
           (_SFT.format("low", "mean_length"), _RL.format("low", "mean_length"),
            _RL.format("low", "accuracy")), ("{:.1f}", "{:.1f}", "{:.2f}")),
    Figure(_DOC, "drop their bare answers ({} -> {}, {} -> {} tokens; accuracy {} -> {}, {} -> {})",
           EFFORT, tuple(path.format(level, field) for field in ("mean_length", "accuracy")
                         for level in ("high", "max") for path in (_SFT, _RL)),
           ("{:.1f}",) * 4 + ("{:.2f}",) * 4),
    Figure(_DOC, "low {} tokens at accuracy {}, high {} at {}, max {} at {} (mean", EFFORT,
           tuple(_over_seeds(level, field) for level in _LEVELS
                 for field in ("mean_length", "accuracy")),
           (_length_interval, _accuracy_interval) * 3),
    Figure(_DOC, "answers low in about {} tokens and high / max in about {},", EFFORT,
           (_over_seeds("low", "mean_length/mean"), _over_seeds("high", "mean_length/mean")),
           "{:.0f}"),
    Figure(_DOC, "the levels mixed falls ({} -> {})", EFFORT, _greedy(_PENALTY), "{:.3f}"),
    Figure(_DOC, "the column steps (about {} tokens, as high and max answer after RL)", EFFORT,
           (_over_seeds("max", "mean_length/mean"),), "{:.0f}"),
)

NOT_MEASURED = tuple(NotMeasured(_DOC, quote, why) for quote, why in (
    ("(0.5 / 1 / 2 times its median length, a multiplier falling from 2 to 1)",
     "the first try's setting (experiments/configs/effort.gin)"),
    ("(mean, 95% t interval)", INTERVAL),
))
GENERATED = ()
