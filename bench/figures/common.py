"""What the docs' registries share: the results files several docs quote, the formats the docs
write figures in, and the reasons a number only looks measured."""

COMMANDS = "bench/results/commands.json"
MOE = "docs/moe/results.json"
AHEAD = "docs/ahead/compare.json"
VERIFIERS = "bench/results/verifiers.json"
EFFORT = "docs/effort/second_try.json"
DISTILL = "docs/distillation/results.json"

CONFIG = "a setting, not a measurement"
DEFAULT = "a default of the loss or transform"
EXAMPLE = "a binding in an example"
BOUND = "a round bound the measured figures beside it are read against"
UNRECORDED = "measured, never recorded in a results file, and the doc says so"
INTERVAL = "the interval's level"
ROUGH = "a command's rough length, a guide to running it and not a result"
MACHINE = "the machine's size, not a measurement"
EARLIER = "an earlier run, whose results file a later one replaced: the doc names the commit"
GIB = 2**30


def min_s(seconds: float) -> str:
  """1967 -> '32 min 47 s', as the docs write durations."""
  whole, rest = divmod(round(seconds), 60)
  return f"{whole} min {rest} s" if whole else f"{rest} s"


def minutes(seconds: float) -> str:
  """246 -> '4': whole minutes, for 'about 4 minutes'."""
  return f"{seconds / 60:.0f}"


def count(n: int) -> str:
  """5 -> 'five', as prose writes a small count."""
  return "zero one two three four five six seven eight nine ten".split()[n]


def points(difference: float) -> str:
  """-0.0344 -> '-3.4': a difference in accuracy in points, signed."""
  return f"{100 * difference:+.1f}"


def points_below(difference: float) -> str:
  """-0.0344 -> '3.4', for '3.4 points below'."""
  return f"{-100 * difference:.1f}"


def points_interval(cell: dict) -> str:
  """A difference in accuracy with its interval (experiments/stats.py), in points:
  '-3.4 [-8.9, +2.1]'."""
  return f"{points(cell['mean'])} [{points(cell['low'])}, {points(cell['high'])}]"
