"""README.md's figures: the commands it times, what the quickstart and the demonstrations
print, and the figures it quotes from other docs' results."""

from .check import Figure, NotMeasured
from .common import AHEAD, COMMANDS, CONFIG, DISTILL, EFFORT, INTERVAL, MOE, VERIFIERS, count
from .common import min_s, minutes, points_below


def _rl_seconds(seconds: dict) -> list[float]:
  """docs/effort/second_try.json: each seed's RL time ("rl", then "rl_seed1", ...)."""
  return [value for key, value in seconds.items() if key.startswith("rl")]


def _fastest_rl(seconds: dict) -> str:
  return f"{min(_rl_seconds(seconds)):.0f}"


def _slowest_rl(seconds: dict) -> str:
  return f"{max(_rl_seconds(seconds)):.0f}"


def _largest_mismatch(seeds: list[dict]) -> list[float]:
  """docs/moe/results.json: each seed's largest per-token engine-vs-trainer log-prob gap."""
  return [seed["max"]["engine_logp_diff_max"] for seed in seeds]


def _least_largest_mismatch(seeds: list[dict]) -> str:
  return f"{min(_largest_mismatch(seeds)):.1f}"


def _most_largest_mismatch(seeds: list[dict]) -> str:
  return f"{max(_largest_mismatch(seeds)):.1f}"


def _most_largest_mismatch_replayed(seeds: list[dict]) -> str:
  return f"{max(_largest_mismatch(seeds)):.2f}"


def _speedup(backends: dict) -> str:
  """bench/results/verifiers.json: our checks per second in-process over math-verify's."""
  ours, theirs = (backends[name]["checks_per_second"] for name in ("longrl", "math_verify"))
  return f"{ours / theirs:.0f}"


def _none_or_count(n: int) -> str:
  return "none" if n == 0 else str(n)


def _student_gap(accuracy: dict) -> str:
  """docs/distillation/results.json: the student's largest distance from an expert on that
  expert's own domain."""
  gap = max(abs(accuracy["student"][d] - accuracy["expert_" + d][d]) for d in ("add2", "add3"))
  return f"{gap:.3f}"


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
           ("differences/ahead_k1_keep - lockstep/eval_accuracy/mean",), points_below),
    Figure("README.md", "on average ({} with `Objective.correction = @tis()`)", AHEAD,
           ("differences/ahead_k1_tis - lockstep/eval_accuracy/mean",), points_below),
    # Your own model
    Figure("README.md", "the gains measured were +{} to +{} over", COMMANDS,
           (_GAIN + "qwen2/low", _GAIN + "qwen2/high"), "{:.2f}"),
    Figure("README.md", "over {} runs, and", COMMANDS, (_GAIN + "qwen2/runs",), count),
    Figure("README.md", "and +{} to +{} over", COMMANDS,
           (_GAIN + "qwen3/low", _GAIN + "qwen3/high"), "{:.2f}"),
    Figure("README.md", "over {} for the tiny Qwen3", COMMANDS, (_GAIN + "qwen3/runs",), count),
    # Real checkpoints: the per-token mismatch's largest value in each seed of docs/moe/
    Figure("README.md", "the largest per-token mismatch {} to", MOE, ("arms/off",),
           _least_largest_mismatch),
    Figure("README.md", "to {} without, at most", MOE, ("arms/off",),
           _most_largest_mismatch),
    Figure("README.md", "at most {} with)", MOE, ("arms/on",),
           _most_largest_mismatch_replayed),
    # Verifiers and evaluation
    Figure("README.md", "On {} labelled pairs", VERIFIERS, ("math_pairs/pairs",)),
    Figure("README.md", "agrees with the labels on {} (math-verify: {})", VERIFIERS,
           (_VERIFIERS + "longrl/accuracy", _VERIFIERS + "math_verify/accuracy"), "{:.0%}"),
    Figure("README.md", "fewer false positives ({} against {},", VERIFIERS,
           (_VERIFIERS + "longrl/false_positives", _VERIFIERS + "math_verify/false_positives")),
    Figure("README.md", "{} on a label we stand behind", VERIFIERS,
           (_VERIFIERS + "longrl/false_positives_uncaveated",),
           _none_or_count),
    Figure("README.md", "and {}x the checks per second one at a time", VERIFIERS,
           ("math_pairs/backends",), _speedup),
    Figure("README.md", "(a {} s warm start", EFFORT,
           ("variants/conditioned/seconds/sft",), "{:.0f}"),
    Figure("README.md", "then {} to", EFFORT, (_PENALTY + "seconds",),
           _fastest_rl),
    Figure("README.md", "to {} s of RL a seed", EFFORT, (_PENALTY + "seconds",),
           _slowest_rl),
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
           ("accuracy",), _student_gap),
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
)

AGENTS = "docs/agents/results.json"
FIGURES += (
    Figure("README.md", "the agent's success went from {} to {} and its calls of the "
           "calculator from {} to {}", AGENTS, ("before/success", "after/success",
                                                "before/tool_calls_rate", "after/tool_calls_rate"),
           "{:.2f}"),
    Figure("README.md", "episodes calling it rose from {} at the first step to {} at the last "
           "({} min on the 2-core CPU", AGENTS, ("tool_calls_rate_per_step/0",
                                                  "tool_calls_rate_per_step", "seconds"),
           ("{:.2f}", lambda rates: f"{rates[-1]:.2f}", lambda s: f"{s / 60:.1f}")),
    Figure("README.md", "{} RL steps of GRPO over 16", AGENTS, ("steps",)),
)

NOT_MEASURED = (
    NotMeasured("README.md", "in 60% of the problems", "the demonstrator's setting (sloppy=0.6)"),
    NotMeasured("README.md", "{'tau': 0.05}", CONFIG),
    NotMeasured("README.md", "GRPO's default 0.04", CONFIG),
    NotMeasured("README.md", "`entropy_collapse.fraction = 0.2`", CONFIG),
    NotMeasured("README.md", "the writer is tensorboardX, 90 KB against tensorboard's ~55 MB",
                "the two packages' sizes on the registry (pyproject.toml), not a run of ours"),
    NotMeasured("README.md", "a held-out accuracy gain of at least 0.15",
                "the test's threshold; the measured gains follow it"),
    NotMeasured("README.md", "with 128 x 128 block scales", "DeepSeek-V3's FP8 layout"),
    NotMeasured("README.md", '"factor": 4.0', CONFIG),
    NotMeasured("README.md", "(Kimi k1.5 sec. 2.4)", "a citation"),
    NotMeasured("README.md", "at least 1.5x as long", "k1.5's rule for DPO pairs"),
    NotMeasured("README.md", "{'reward_weight': 0.5}", CONFIG),
    NotMeasured("README.md", "{'topk_coef': 1.0}", CONFIG),
    NotMeasured("README.md", "30% of the demonstrations call it", "the task's setting"),
    NotMeasured("README.md", "call the tool 30% of the time", "the checkpoint's setting"),
    NotMeasured("README.md", "DIR --tool_calls 0.3`", "the checkpoint's setting"),
    NotMeasured("README.md", "experiments/agent_demo.py # about 6 minutes",
                "a command's rough length"),
    NotMeasured("README.md", "the 95% interval of each", INTERVAL),
    NotMeasured("README.md", "with 95% intervals", INTERVAL),
)
GENERATED = ()
