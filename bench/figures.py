"""Where every figure the docs quote comes from: each tied to the results file that holds it,
and the numbers that only look measured (settings, thresholds, citations) listed with why.

A figure is registered here rather than marked in the Markdown, so that the docs stay plain
to read and edit, and one table answers "where does this number come from?". A `Figure` is the
doc's own words around the figure with `{}` where it stands, the results file, a key path into
it and a format that turns the stored value into the doc's text. `problems()` renders each
quote from its file and looks for it in its doc (whitespace runs read as one space, since
Markdown wraps lines anywhere), and scans each doc of `COVERED` for numbers that look measured
(a decimal, or a number with a unit: %, 20x, s, min, GiB, tokens, passed, points...) outside
every registered quote and every `NotMeasured` one. tests/test_figures.py holds it to none;
`python bench/figures.py` prints the same list.

It does not produce results: bench/*.py and the experiments write them, and
bench/results/commands.json records the README's commands as timed by hand. Nor can the scan
tell a bare integer ("5 seeds", "3 against 15") from prose: those are registered where they are
measured, with nothing to force it. Blocks of Python are code: not scanned, not quoted.

Covered so far: README.md, docs/architecture.md and docs/objectives.md. bench/README.md and
the rest of docs/ join `COVERED` once their figures are registered here (a few of
bench/README.md's are already).
"""

import dataclasses
import json
import os
import re
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COVERED = ("README.md", "docs/architecture.md", "docs/objectives.md")


@dataclasses.dataclass(frozen=True)
class Figure:
  """`quote` as it reads in `doc`, one `{}` per key of `keys`: the value at that key path in
  `source`, formatted by `fmt` (a format string or a function). A path joins with "/" dict
  keys, list indices and `field=value,...` (the one record of a list with those fields), and
  may end on a whole subtree when `fmt` derives the figure from it."""
  doc: str
  quote: str
  source: str
  keys: tuple[str, ...]
  fmt: str | Callable[[Any], str] = "{}"


@dataclasses.dataclass(frozen=True)
class NotMeasured:
  """Numbers in `quote` (as it reads in `doc`) that look measured and are not, and why."""
  doc: str
  quote: str
  why: str


def min_s(seconds: float) -> str:
  """1967 -> '32 min 47 s', as the docs write durations."""
  whole, rest = divmod(round(seconds), 60)
  return f"{whole} min {rest} s" if whole else f"{rest} s"


def minutes(seconds: float) -> str:
  """246 -> '4': whole minutes, for 'about 4 minutes'."""
  return f"{seconds / 60:.0f}"


def _count(n: int) -> str:
  """5 -> 'five', as prose writes a small count."""
  return "zero one two three four five six seven eight nine ten".split()[n]


def _rl_seconds(seconds: dict) -> list[float]:
  """docs/effort/second_try.json: each seed's RL time ("rl", then "rl_seed1", ...)."""
  return [value for key, value in seconds.items() if key.startswith("rl")]


def _largest_mismatch(seeds: list[dict]) -> list[float]:
  """docs/moe/results.json: each seed's largest per-token engine-vs-trainer log-prob gap."""
  return [seed["max"]["engine_logp_diff_max"] for seed in seeds]


def _speedup(backends: dict) -> float:
  """bench/results/verifiers.json: our checks per second in-process over math-verify's."""
  return backends["longrl"]["checks_per_second"] / backends["math_verify"]["checks_per_second"]


def _student_gap(accuracy: dict) -> float:
  """docs/distillation/results.json: the student's largest distance from an expert on that
  expert's own domain."""
  return max(abs(accuracy["student"][d] - accuracy["expert_" + d][d]) for d in ("add2", "add3"))


def _memory(value: float | list[str]) -> str:
  """bench/memory.py's table: bytes as GiB, and the chips the step fits ('none')."""
  return (", ".join(value) or "none") if isinstance(value, list) else f"{value / 2**30:.1f}Gi"


# bench/README.md's table of mixtures on 8 devices: each mesh as the table names it and its
# results file, then the rows (mesh, model, tokens a row) in the table's order: both models at
# 4k and 16k on the float32 meshes, at 16k on the bf16 ones.
_MOE_MESHES = {"fsdp=1 x expert=8": "fsdp1expert8", "fsdp=2 x expert=4": "fsdp2expert4",
               "fsdp=4 x expert=2": "fsdp4expert2", "bf16, fsdp=4 x expert=2": "bf16fsdp4expert2",
               "bf16, fsdp=2 x expert=4": "bf16fsdp2expert4"}
_MOE_ROWS = tuple((mesh, model, tokens) for mesh in tuple(_MOE_MESHES)[:3]
                  for model in ("qwen3-30b-a3b", "moonlight-16b-a3b") for tokens in (4096, 16384)
                  ) + tuple((mesh, model, 16384) for mesh in tuple(_MOE_MESHES)[3:]
                            for model in ("qwen3-30b-a3b", "moonlight-16b-a3b"))

COMMANDS = "bench/results/commands.json"
MOE = "docs/moe/results.json"
AHEAD = "docs/ahead/compare.json"
VERIFIERS = "bench/results/verifiers.json"
EFFORT = "docs/effort/second_try.json"
DISTILL = "docs/distillation/results.json"
_QUICKSTART = "quickstart/last_line/"
_GAIN = "tiny_grpo_math/held_out_accuracy_gain/"
_AGENTIC = "agentic/last_line/"
_VISION = "vision/last_line/"
_SEEDS = "runs/lockstep/eval_accuracy/per_seed/"
_VERIFIERS = "math_pairs/backends/"
_PENALTY = "variants/conditioned_own_penalty/"

FIGURES = (
    # Two commands
    Figure("README.md", "a 2-core CPU: {} on the last machine", COMMANDS,
           ("quickstart/seconds",), min_s),
    Figure("README.md", "longrl never imports sglang): {} and", COMMANDS,
           ("setup_sglang/seconds",), min_s),
    Figure("README.md", "and {} GB of disk on a 2-core machine", COMMANDS,
           ("setup_sglang/disk_gb_after_removing_sglang_kernel",), "{:.0f}"),
    Figure("README.md", "The whole command took {} here", COMMANDS,
           ("test_suite/seconds",), min_s),
    Figure("README.md", "({} passed, {} xfailed; {})", COMMANDS,
           ("test_suite/passed", "test_suite/xfailed", "test_suite/date")),
    # What the quickstart does
    Figure("README.md", "sft_accuracy={} rl_accuracy={}", COMMANDS,
           (_QUICKSTART + "sft_accuracy", _QUICKSTART + "rl_accuracy"), "{:.2f}"),
    Figure("README.md", "over seeds 0-4 it ends at {}, {}, {}, {} and {} with one core", AHEAD,
           tuple(_SEEDS + str(seed) for seed in range(5)), "{:.2f}"),
    # Configuration: rollouts ahead, mean of seeds 0-4 against lockstep, in points
    Figure("README.md", "it ends {} points below lockstep", AHEAD,
           ("differences/ahead_k1_keep - lockstep/eval_accuracy/mean",),
           lambda mean: f"{-100 * mean:.1f}"),
    Figure("README.md", "on average ({} with `Objective.correction = @tis()`)", AHEAD,
           ("differences/ahead_k1_tis - lockstep/eval_accuracy/mean",),
           lambda mean: f"{-100 * mean:.1f}"),
    # Your own model
    Figure("README.md", "the gains measured were +{} to +{} over", COMMANDS,
           (_GAIN + "qwen2/low", _GAIN + "qwen2/high"), "{:.2f}"),
    Figure("README.md", "over {} runs, and", COMMANDS, (_GAIN + "qwen2/runs",), _count),
    Figure("README.md", "and +{} to +{} over", COMMANDS,
           (_GAIN + "qwen3/low", _GAIN + "qwen3/high"), "{:.2f}"),
    Figure("README.md", "over {} for the tiny Qwen3", COMMANDS, (_GAIN + "qwen3/runs",), _count),
    # Real checkpoints: the per-token mismatch's largest value in each seed of docs/moe/
    Figure("README.md", "the largest per-token mismatch {} to", MOE, ("arms/off",),
           lambda seeds: f"{min(_largest_mismatch(seeds)):.1f}"),
    Figure("README.md", "to {} without, at most", MOE, ("arms/off",),
           lambda seeds: f"{max(_largest_mismatch(seeds)):.1f}"),
    Figure("README.md", "at most {} with)", MOE, ("arms/on",),
           lambda seeds: f"{max(_largest_mismatch(seeds)):.2f}"),
    # Verifiers and evaluation
    Figure("README.md", "On {} labelled pairs", VERIFIERS, ("math_pairs/pairs",)),
    Figure("README.md", "agrees with the labels on {} (math-verify: {})", VERIFIERS,
           (_VERIFIERS + "longrl/accuracy", _VERIFIERS + "math_verify/accuracy"), "{:.0%}"),
    Figure("README.md", "fewer false positives ({} against {},", VERIFIERS,
           (_VERIFIERS + "longrl/false_positives", _VERIFIERS + "math_verify/false_positives")),
    Figure("README.md", "{} on a label we stand behind", VERIFIERS,
           (_VERIFIERS + "longrl/false_positives_uncaveated",),
           lambda count: "none" if count == 0 else str(count)),
    Figure("README.md", "and {}x the checks per second one at a time", VERIFIERS,
           ("math_pairs/backends",), lambda backends: f"{_speedup(backends):.0f}"),
    Figure("README.md", "(a {} s warm start", EFFORT,
           ("variants/conditioned/seconds/sft",), "{:.0f}"),
    Figure("README.md", "then {} to", EFFORT, (_PENALTY + "seconds",),
           lambda seconds: f"{min(_rl_seconds(seconds)):.0f}"),
    Figure("README.md", "to {} s of RL a seed", EFFORT, (_PENALTY + "seconds",),
           lambda seconds: f"{max(_rl_seconds(seconds)):.0f}"),
    Figure("README.md", "answers low in about {} tokens", EFFORT,
           (_PENALTY + "rl_over_seeds/low/mean_length/mean",), "{:.0f}"),
    Figure("README.md", "and high / max in about {}", EFFORT,
           (_PENALTY + "rl_over_seeds/high/mean_length/mean",), "{:.0f}"),
    Figure("README.md", "and high / max in about {}", EFFORT,
           (_PENALTY + "rl_over_seeds/max/mean_length/mean",), "{:.0f}"),
    # On-policy distillation
    Figure("README.md", "into one student in about {} minutes", DISTILL, ("minutes",), "{:.0f}"),
    Figure("README.md", "or trained there in about {} minutes", DISTILL, ("minutes",), "{:.0f}"),
    Figure("README.md", "matches each expert on its domain within {} and", DISTILL,
           ("accuracy",), lambda accuracy: f"{_student_gap(accuracy):.3f}"),
    # Agents and tools
    Figure("README.md", "In about {} minutes on the 2-core CPU (one seed)", COMMANDS,
           ("agentic/seconds",), minutes),
    Figure("README.md", "agentic.gin # ~{} minutes", COMMANDS, ("agentic/seconds",), minutes),
    Figure("README.md", "accuracy goes from {} after SFT", COMMANDS,
           (_AGENTIC + "sft_accuracy",), "{:.2f}"),
    Figure("README.md", "calls) to {} after RL, and the held-out call rate from {} to {};",
           COMMANDS, (_AGENTIC + "rl_accuracy", _AGENTIC + "sft_tool_calls_rate",
                      _AGENTIC + "rl_tool_calls_rate"), "{:.2f}"),
    Figure("README.md",
           "sft_accuracy={} rl_accuracy={} sft_tool_calls_rate={} rl_tool_calls_rate={}",
           COMMANDS, (_AGENTIC + "sft_accuracy", _AGENTIC + "rl_accuracy",
                      _AGENTIC + "sft_tool_calls_rate", _AGENTIC + "rl_tool_calls_rate"),
           "{:.2f}"),
    Figure("README.md", "from plain calls ({} min on the 2-core", COMMANDS,
           ("agentic/notebook_minutes",)),
    # Images
    Figure("README.md", "this was written on ({}):", COMMANDS, ("vision/seconds",), min_s),
    Figure("README.md",
           "`sft_accuracy_rendered={} rl_accuracy_rendered={} sft_accuracy_text={} "
           "rl_accuracy_text={} sft_accuracy_scenes={} rl_accuracy_scenes={}`", COMMANDS,
           tuple(_VISION + f"{stage}_accuracy_{task}" for task in ("rendered", "text", "scenes")
                 for stage in ("sft", "rl")), "{:.2f}"),
    Figure("README.md", "100 a task; at commit {})", COMMANDS, ("vision/commit",)),
) + tuple(
    # bench/README.md (not yet covered whole): the compiled memory of mixtures on 8 devices.
    Figure("bench/README.md", f"{mesh} {model} {tokens} {{}} {{}} {{}}",
           f"bench/results/memory_moe/{_MOE_MESHES[mesh]}.json",
           tuple(f"results/model={model},tokens={tokens}/{field}"
                 for field in ("peak", "temporaries", "fits")), _memory)
    for mesh, model, tokens in _MOE_ROWS)

_CONFIG = "a setting, not a measurement"
_DEFAULT = "a default of the loss or transform"
_EXAMPLE = "a binding in an example"
NOT_MEASURED = (
    NotMeasured("README.md", "in 60% of the problems", "the demonstrator's setting (sloppy=0.6)"),
    NotMeasured("README.md", "{'tau': 0.05}", _CONFIG),
    NotMeasured("README.md", "GRPO's default 0.04", _CONFIG),
    NotMeasured("README.md", "`entropy_collapse.fraction = 0.2`", _CONFIG),
    NotMeasured("README.md", "the writer is tensorboardX, 90 KB against tensorboard's ~55 MB",
                "the two packages' sizes on the registry (pyproject.toml), not a run of ours"),
    NotMeasured("README.md", "a held-out accuracy gain of at least 0.15",
                "the test's threshold; the measured gains follow it"),
    NotMeasured("README.md", "with 128 x 128 block scales", "DeepSeek-V3's FP8 layout"),
    NotMeasured("README.md", '"factor": 4.0', _CONFIG),
    NotMeasured("README.md", "(Kimi k1.5 sec. 2.4)", "a citation"),
    NotMeasured("README.md", "at least 1.5x as long", "k1.5's rule for DPO pairs"),
    NotMeasured("README.md", "{'reward_weight': 0.5}", _CONFIG),
    NotMeasured("README.md", "{'topk_coef': 1.0}", _CONFIG),
    NotMeasured("README.md", "30% of the demonstrations call it", "the task's setting"),
    NotMeasured("README.md", "the 95% interval of each", "the interval's level"),
    NotMeasured("README.md", "with 95% intervals", "the interval's level"),
    NotMeasured("docs/architecture.md", "{'my_coef': 0.2, 'kl_coef': 0.01,", _EXAMPLE),
) + tuple(NotMeasured("docs/objectives.md", quote, why) for quote, why in (
    ("`tau=0.01` (OpenKimi", _DEFAULT),
    ("`alpha=-1, beta=1, tau=0.01, window='log_ratio'`", _DEFAULT),
    ("`eps_low=eps_high=0.2, dual_clip=None`", _DEFAULT),
    ("`clip_eps=0.2`, and its KL defaults `kl_coef=0.04, kl_estimator='k3'`", _DEFAULT),
    ("`clip_eps=0.2` (`norm_length=None`", _DEFAULT),
    ("`eps_low=0.2, eps_high=0.28`", _DEFAULT),
    ("`eps_high=0.2` (TRL's cap 5.0 = `eps_high=4`) | MiniMax-M1 sec. 3.1",
     "a default, TRL's and a citation"),
    ("`advantage_clip=5.0` (ours), `reward_weight=0.0`, `eps_low=eps_high=0.2`", _DEFAULT),
    ("MOPD (arXiv 2606.30406)", "a citation"),
    ("`beta=0.1` | DPO (Rafailov et al. 2023); k1.5 sec. 2.4", "a default and citations"),
    ("(every loss's default but GRPO's 0.04)", _DEFAULT),
    ("`lambda = 0.5 - (len - min)/(max - min)`", "k1.5's formula"),
    ("`target_length, alpha=0.5`", _DEFAULT),
    ("`quantile=0.5, rho=0`", _DEFAULT),
    ("`multipliers=(0.5, 1, 2)`, `quantile=0.5`", _DEFAULT),
    ("`low=0.5, high=5` (ours) | IcePop (Ring-1T, arXiv:2510.18855)", "a default and a citation"),
    ("`low=0.9, high=1.1` (ours)", _DEFAULT),
    ("{'my_coef': 0.2}", _EXAMPLE),
    ("'kl_coef': 0.01}", _EXAMPLE)))

# A decimal that is not part of a version (0.5.23) or a name (Qwen2.5, k1.5), or a number with a
# unit that measurements carry.
MEASURED = re.compile(r"""(?<![\w.])(?:
    \d[\d,]*(?:\.\d+)?(?:x|×)(?!\w)
  | \d[\d,]*(?:\.\d+)?\s?(?:%|ms|s|min|minutes?|seconds?|hours?|[KMGT]i?B|Gi|tokens?(?:/s)?
                          |passed|failed|xfailed|skipped|points?)(?!\w)
  | \d+\.\d+(?![\w.]*\d|\w)
)""", re.X)
PYTHON_BLOCK = re.compile(r"```python .*?```")


def _text(doc: str, root: str) -> str:
  """The doc with every run of whitespace one space."""
  with open(os.path.join(root, doc)) as f:
    return " ".join(f.read().split())


def _value(data: Any, path: str, source: str) -> Any:
  """What `path` (see `Figure`) reads in `data`, loaded from `source`."""
  for key in path.split("/"):
    if isinstance(data, list) and "=" in key:
      fields = dict(pair.split("=", 1) for pair in key.split(","))
      records = [r for r in data if all(str(r.get(f)) == v for f, v in fields.items())]
      if len(records) != 1:
        raise KeyError(f"{source}: {len(records)} records with {key!r} on the path {path!r}")
      data = records[0]
    elif isinstance(data, list) and key.isdigit() and int(key) < len(data):
      data = data[int(key)]
    elif isinstance(data, dict) and key in data:
      data = data[key]
    else:
      raise KeyError(f"{source}: no {key!r} on the path {path!r} (there: "
                     f"{list(data) if isinstance(data, dict) else type(data).__name__})")
  return data


def render(figure: Figure, root: str = ROOT) -> str:
  """The quote with the figure as its results file gives it."""
  if figure.quote.count("{}") != len(figure.keys):
    raise ValueError(f"{figure.quote.count('{}')} slots for {len(figure.keys)} keys")
  with open(os.path.join(root, figure.source)) as f:
    data = json.load(f)
  fmt = figure.fmt.format if isinstance(figure.fmt, str) else figure.fmt
  texts = [fmt(_value(data, key, figure.source)) for key in figure.keys]
  return " ".join(figure.quote.format(*texts).split())


def _places(text: str, quote: str, slots: bool) -> list[tuple[int, int]]:
  """Where `quote` stands in `text`; with `slots`, each `{}` of it stands for up to 40
  characters, and one that ends the quote ends where its figure does."""
  parts = [re.escape(" ".join(part.split())) for part in
           (quote.split("{}") if slots else [quote])]
  pattern = ".{1,40}?".join(parts) + (r"(?![\w.])" if slots and quote.endswith("{}") else "")
  return [(m.start(), m.end()) for m in re.finditer(pattern, text)]


def problems(figures: tuple[Figure, ...] = FIGURES,
             not_measured: tuple[NotMeasured, ...] = NOT_MEASURED,
             covered: tuple[str, ...] = COVERED, root: str = ROOT) -> list[str]:
  """One line per figure its file does not give as the doc quotes it, per `NotMeasured` quote
  the doc lacks, and per number of a covered doc that looks measured and is neither."""
  found = []
  texts = {doc: _text(doc, root) for doc in {e.doc for e in figures + not_measured} | {*covered}}
  places = {doc: [] for doc in texts}  # (start, end) of every quote, in its doc's text
  for figure in figures:
    text = texts[figure.doc]
    try:
      quote = render(figure, root)
    except (OSError, KeyError, ValueError) as error:
      found.append(f"{figure.doc}: {figure.quote!r}: {error}")
      quote = None
    if quote is not None and quote not in text:
      found.append(f"{figure.doc}: {figure.source} gives {quote!r}, which the doc does not say")
      quote = None
    # A figure that disagrees with its file is reported once, above: where its quote stands,
    # whatever the figure there says, its numbers are not reported again as unregistered.
    places[figure.doc] += (_places(text, quote, slots=False) if quote is not None else
                           _places(text, figure.quote, slots=True))
  for entry in not_measured:
    if not _places(texts[entry.doc], entry.quote, slots=False):
      found.append(f"{entry.doc}: {entry.quote!r}, listed as not measured, is not in it")
    places[entry.doc] += _places(texts[entry.doc], entry.quote, slots=False)
  for doc in covered:
    text = texts[doc]
    skipped = places[doc] + [(m.start(), m.end()) for m in PYTHON_BLOCK.finditer(text)]
    for m in MEASURED.finditer(text):
      if not any(start <= m.start() and m.end() <= end for start, end in skipped):
        found.append(f"{doc}: {m.group()!r} in {text[max(0, m.start() - 40):m.end() + 20]!r} "
                     "looks measured: register it in bench/figures.py (FIGURES) or say why "
                     "it is not (NOT_MEASURED)")
  return found


if __name__ == "__main__":
  listed = problems()
  print("\n".join(listed) or f"every figure of {', '.join(COVERED)} agrees with its file")
  sys.exit(1 if listed else 0)
