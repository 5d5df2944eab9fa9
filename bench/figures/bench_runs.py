"""bench/README.md's sections on whole runs, each section's figures from the bench/results/ file
its script writes: RL iterations against TRL and Tunix, multi-turn episodes in waves, and a fleet
of servers and a train step over processes. bench_readme.py covers them with the rest."""

import statistics

from .check import Figure, NotMeasured
from .common import CONFIG, GIB, MACHINE, ROUGH, UNRECORDED

_DOC = "bench/README.md"


# ## `bench/iteration.py`: each part's row of the table and each pair's ratio, as
# bench/iteration.py's report prints them, and what the text reads in them.
ITERATION = "bench/results/iteration.json"
_BREAKDOWN = ("generate_s", "verify_s", "score_s", "pack_s", "train_s", "weight_sync_s")
_IDLE = ("trainer_idle_s", "engine_idle_s")


def _kept(part: dict) -> list[dict]:
  """A part's kept iterations, of every turn."""
  return [iteration for turn in part["turns"] for iteration in turn]


def _median(part: dict, key: str) -> float:
  return statistics.median(iteration[key] for iteration in _kept(part))


def _iteration_row(part: dict) -> str:
  """A part's row: seconds and iterations per second, tokens per second, peak memory, and ours'
  median breakdown."""
  seconds = _median(part, "seconds")
  tokens = statistics.median(i["completion_tokens"] / i["seconds"] for i in _kept(part))
  row = f"{seconds:.2f} {1 / seconds:.3f} {tokens:.0f} {part['peak_rss_bytes'] / GIB:.2f}G"
  if "train_s" not in _kept(part)[0]:
    return row
  return (row + " " + " ".join(f"{_median(part, key):.2f}" for key in _BREAKDOWN) + " | "
          + " ".join(f"{_median(part, key):.2f}" for key in _IDLE))


def _turn_ratios(ours: str, other: str):
  """What reads, turn by turn, `other`'s median seconds over `ours`'."""
  def ratios(results: dict) -> list[float]:
    return [statistics.median(i["seconds"] for i in b) / statistics.median(i["seconds"] for i in a)
            for a, b in zip(results[ours]["turns"], results[other]["turns"])]
  return ratios


def _ratio_line(ours: str, other: str) -> Figure:
  """A pair's line: the median ratio over the turns, its least and most, and the turns."""
  def line(results: dict) -> str:
    ratios = _turn_ratios(ours, other)(results)
    return (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f} over "
            f"{len(ratios)} turns")
  return Figure(_DOC, f"{ours} vs {other}: {{}}; > 1: {ours} faster)", ITERATION, ("",), line)


def _ratio(ours: str, other: str, digits: int):
  """The format that reads the median ratio of `ours` over `other`, to `digits` decimals."""
  return lambda results: f"{statistics.median(_turn_ratios(ours, other)(results)):.{digits}f}"


def _positions(config: dict) -> str:
  return str(config["prompt_len"] + config["new_tokens"])


_ITERATION = (
    *(Figure(_DOC, f"{part} {{}}", ITERATION, (part,), _iteration_row)
      for part in ("ours_sync", "ours_sync_server", "ours_ahead", "trl", "tunix")),
    _ratio_line("ours_ahead", "ours_sync"),
    _ratio_line("ours_ahead", "ours_sync_server"),
    _ratio_line("ours_sync", "trl"),
    _ratio_line("ours_sync", "tunix"),
    Figure(_DOC, "Ours in lockstep makes {}x TRL's iterations and {}x Tunix's", ITERATION,
           ("", ""), (_ratio("ours_sync", "trl", 1), _ratio("ours_sync", "tunix", 1))),
    Figure(_DOC, "(generation {} s, train {} s): {}x lockstep with the same pinning", ITERATION,
           ("ours_ahead", "ours_ahead", ""),
           (lambda part: f"{_median(part, 'generate_s'):.1f}",
            lambda part: f"{_median(part, 'train_s'):.1f}",
            _ratio("ours_ahead", "ours_sync_server", 2))),
    Figure(_DOC, "Against lockstep on both cores it is {}x", ITERATION, ("",),
           _ratio("ours_ahead", "ours_sync", 2)),
    Figure(_DOC, "the trainer waits for nothing (idle {} s) and the engine {} s per iteration",
           ITERATION, ("ours_ahead", "ours_ahead"),
           tuple(lambda part, key=key: f"{_median(part, key):.2f}" for key in _IDLE)),
    Figure(_DOC, "one GRPO step (clip {}, no KL)", ITERATION, ("config/clip_eps",)),
    Figure(_DOC, "so nearly every completion runs to {} tokens", ITERATION,
           ("config/new_tokens",)),
    Figure(_DOC, "its loss takes logits over all {} positions", ITERATION, ("config",),
           _positions),
)
_ITERATION_NOT_MEASURED = (
    NotMeasured(_DOC, "[--rounds 3] [--steps 4]` (about 12 minutes;", ROUGH),
    NotMeasured(_DOC, "On the 2-core, 24 GiB CPU machine of 2026-12-03", MACHINE),
    NotMeasured(_DOC, "took 4.82 s on one core, now 1.93 s (greedy decoding 1.96 s; timed at "
                "commit f20c672, not recorded)", UNRECORDED),
)

# ## `bench/agentic.py`: each mode's row of the table and the ratios' lines, as bench/agentic.py
# prints them, the run's settings and what the text reads in the rows. The other runs and the
# engine's per-call costs were measured at commit 36ca1b0 and not recorded.
AGENTIC = "bench/results/agentic.json"


def _agentic_row(mode: dict) -> str:
  """A mode's row: episodes and policy tokens per second, the median round, the engine's calls,
  steps, utilisation and share, the episodes' turns and policy tokens, and how many were
  right."""
  turns = "/".join(str(mode["turns"].get(str(k), 0)) for k in (1, 2, 3))
  low, _, median, _, high = mode["policy_tokens_quartiles"]
  return (f"{mode['episodes_per_second']:.1f} {mode['policy_tokens_per_second']:.0f} "
          f"{statistics.median(mode['seconds']):.3f} {mode['engine_calls']} "
          f"{mode['decode_steps']} {mode['utilisation']:.2f} {mode['engine_share']:.0%} {turns} "
          f"{low:.0f}/{median:.0f}/{high:.0f} {mode['correct']}/{mode['episodes']}")


def _rounds(rounds: list[float]) -> str:
  return ", ".join(f"{ratio:.2f}" for ratio in rounds)


_AGENTIC = (
    *(Figure(_DOC, f"{mode} {{}}", AGENTIC, (f"results/{mode}",), _agentic_row)
      for mode in ("one_at_a_time", "waves")),
    Figure(_DOC, "waves / one at a time per round: {}; pooled {}; policy tokens/s {}", AGENTIC,
           ("rounds", "pooled", "policy_tokens_ratio"), (_rounds, "{:.2f}", "{:.2f}")),
    Figure(_DOC, "waves / one at a time = {} episodes/s, the median round", AGENTIC, ("ratio",),
           "{:.2f}"),
    Figure(_DOC, "Results on the {}-core CPU machine ({}, an Intel Xeon", AGENTIC,
           ("machine/cores", "machine/date"), ("{}", lambda date: date[:10])),
    Figure(_DOC, "SFT'd for {} steps on ToolArithmetic", AGENTIC, ("sft_steps",)),
    Figure(_DOC, "{} held-out problems under agentic.gin's budgets", AGENTIC, ("episodes",)),
    Figure(_DOC, "{} rounds of both modes alternate", AGENTIC, ("rounds",), len),
    Figure(_DOC, "(`min_batch={}`), so the lone episode", AGENTIC, ("min_batch",)),
    Figure(_DOC, "a few more one-turn episodes ({} against {})", AGENTIC,
           ("results/waves/turns/1", "results/one_at_a_time/turns/1")),
    Figure(_DOC, "One at a time is mostly fixed cost: {} calls for {} episodes. The waves make {} "
           "calls", AGENTIC, ("results/one_at_a_time/engine_calls", "episodes",
                              "results/waves/engine_calls")),
    Figure(_DOC, "rambling to the {}-token turn cap holds the call for {} steps", AGENTIC,
           ("max_turn_tokens", "max_turn_tokens")),
    Figure(_DOC, "(utilisation {})", AGENTIC, ("results/waves/utilisation",), "{:.0%}"),
)
_AGENTIC_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/agentic.py # ~2 minutes on 2 CPU cores", ROUGH),
    NotMeasured(_DOC, "(target >= 3)", "a target, not a measurement"),
    NotMeasured(_DOC, "gave 2.73x (a busier machine) and, before the driver rounded a wave's token "
                "allowance up instead of down (below), 3.18x. With `--min_batch 8` (JaxEngine's "
                "default, what the loop uses: a lone episode's calls run 8 rows) the run before "
                "that change gave 43.7 against 373.6 episodes/s, 8.81x (6.60-9.69 over 7 rounds), "
                "policy tokens/s 7.81x (the three runs of commit 36ca1b0, not recorded)",
                UNRECORDED),
    NotMeasured(_DOC, "Per call (timed at commit 36ca1b0, not recorded), the embedded engine costs "
                "~3.2 ms fixed at one row (host padding, dispatch, prefill, the copy back) plus "
                "0.10 ms per decode step; at 64 rows ~12 ms plus 1.55 ms per step (24 us per "
                "row-step: past ~8 rows the tiny model is compute-bound on two cores, so a "
                "batched step is not free, and batching can gain at most ~4x per token here)",
                UNRECORDED),
    NotMeasured(_DOC, "(answers end by ~8 tokens,", "the answer format's length, not a "
                "measurement"),
    NotMeasured(_DOC, "5 calls and 70 steps (at commit 36ca1b0, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "(26 tokens left became 16)", "an example of the rounding, not a "
                "measurement"),
    NotMeasured(_DOC, "in chunks of 8 or 16 tokens", CONFIG),
    NotMeasured(_DOC, "took the waves 0.35 s and 0.26 s against 0.24 s (at commit 36ca1b0, not "
                "recorded)", UNRECORDED),
)

# ## `bench/scaleout.py`: each fleet's and each trainer process's line and the last line, as
# bench/scaleout.py prints them, and what the text reads in them.
SCALEOUT = "bench/results/scaleout.json"


def _fleet_line(servers: int) -> Figure:
  return Figure(_DOC, f"{servers} server(s): router {{}} tokens/s, direct {{}} tokens/s, weight "
                "sync {} s (launch {} s)", SCALEOUT,
                tuple(f"fleet/servers={servers}/{key}" for key in (
                    "router_tokens_per_s", "direct_tokens_per_s", "weight_sync_s", "launch_s")),
                ("{:.0f}", "{:.0f}", "{:.2f}", "{:.1f}"))


def _trainer_line(processes: int, process: int) -> Figure:
  devices = 2 // processes
  return Figure(_DOC, f"{processes} process(es) x {devices} device(s), process {process}: peak "
                "RSS {} GiB (runtime {}), {} s/step", SCALEOUT,
                tuple(f"trainers/runs/processes={processes}/rows/process={process}/{key}"
                      for key in ("peak_rss_gib", "runtime_rss_gib", "step_s")), "{:.2f}")


def _router_over_direct(fleet: list[dict]) -> str:
  """The router's tokens/s over the client's own, at each fleet: '0.97x, 0.89x, 0.95x'."""
  return ", ".join(f"{r['router_tokens_per_s'] / r['direct_tokens_per_s']:.2f}x" for r in fleet)


def _router_cost(fleet: list[dict]) -> str:
  """The least and most the router costs, in percent of the client's tokens/s: '3-11'."""
  costs = [100 * (1 - r["router_tokens_per_s"] / r["direct_tokens_per_s"]) for r in fleet]
  return f"{min(costs):.0f}-{max(costs):.0f}"


def _fleet_growth(fleet: list[dict]) -> str:
  """The largest fleet's tokens/s through the router over one server's."""
  return f"{fleet[-1]['router_tokens_per_s'] / fleet[0]['router_tokens_per_s']:.1f}"


def _state_ratio(runs: list[dict]) -> str:
  """The state's part of the peak (peak less the runtime's) of two processes over one's."""
  state = {run["processes"]: max(r["peak_rss_gib"] - r["runtime_rss_gib"] for r in run["rows"])
           for run in runs}
  return f"{state[2] / state[1]:.2f}"


def _slower(runs: list[dict]) -> str:
  """Two processes' step time over one's."""
  step = {run["processes"]: max(r["step_s"] for r in run["rows"]) for run in runs}
  return f"{step[2] / step[1]:.2f}"


def _pass_spread(fleet: list[dict]) -> str:
  """The most a fleet's passes of one path vary: the fastest over the slowest."""
  return f"{max(max(rates) / min(rates) for r in fleet for rates in r['all_rates'].values()):.0f}"


_SCALEOUT = (
    *(_fleet_line(servers) for servers in (1, 2, 4)),
    _trainer_line(1, 0),
    _trainer_line(2, 0),
    _trainer_line(2, 1),
    Figure(_DOC, "{}M params; largest loss difference 1 vs 2 processes {}; peak RSS per process, 2 "
           "processes / 1: {}", SCALEOUT,
           ("trainers/runs/0/rows/0/params", "trainers/max_loss_diff", "trainers/peak_rss_ratio"),
           (lambda params: f"{params / 1e6:.0f}", "{:.2e}", "{:.2f}")),
    Figure(_DOC, "On the {}-core, 24 GiB CPU machine of {} (an Intel Xeon;", SCALEOUT,
           ("machine/cores", "machine/date"), ("{}", lambda date: date[:10])),
    Figure(_DOC, "one RL iteration's generation at the quickstart's sizes (its model with random "
           "weights, {} prompts x {} samples, up to {} new tokens", SCALEOUT,
           ("prompts", "samples", "max_new_tokens")),
    Figure(_DOC, "the same k1.5 train step of a {}M-parameter model (width {}, {} layers) on the "
           "same global batch ({} rows of {} tokens)", SCALEOUT,
           ("trainers/runs/0/rows/0/params", "trainer_model/hidden_size",
            "trainer_model/num_layers", "rows", "seq"),
           (lambda params: f"{params / 1e6:.0f}", "{}", "{}", "{}", "{}")),
    Figure(_DOC, "The router costs {}% of the tokens/s of the client's own balancing ({} at 1, 2, "
           "4 servers)", SCALEOUT, ("fleet", "fleet"), (_router_cost, _router_over_direct)),
    Figure(_DOC, "More servers make more tokens even on 2 cores ({}x with 4)", SCALEOUT,
           ("fleet",), _fleet_growth),
    Figure(_DOC, "A weight sync grows with the fleet ({} s to {} s)", SCALEOUT,
           ("fleet/servers=1/weight_sync_s", "fleet/servers=4/weight_sync_s"), "{:.2f}"),
    Figure(_DOC, "Two processes hold {}x the peak memory of one (the state's part, peak minus "
           "runtime, is {}x)", SCALEOUT, ("trainers/peak_rss_ratio", "trainers/runs"),
           ("{:.2f}", _state_ratio)),
    Figure(_DOC, "The step is {}x slower", SCALEOUT, ("trainers/runs",), _slower),
    Figure(_DOC, "Single passes vary up to {}x", SCALEOUT, ("fleet",), _pass_spread),
)
_SCALEOUT_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/scaleout.py # both parts, ~5 minutes on 2 CPU cores", ROUGH),
    NotMeasured(_DOC, "the median of 5 alternating passes after 3 warm-up passes per path",
                CONFIG),
    NotMeasured(_DOC, "24 GiB CPU machine", MACHINE),
)

FIGURES = _ITERATION + _AGENTIC + _SCALEOUT
NOT_MEASURED = _ITERATION_NOT_MEASURED + _AGENTIC_NOT_MEASURED + _SCALEOUT_NOT_MEASURED
