"""docs/moe/README.md: routing replay off and on over seeds 0-2, from docs/moe/results.json
(experiments/replay_demo.py): each arm's seeds, each a step metric's mean, median and largest
over the 150 steps, and the held-out accuracy after SFT and after RL."""

from .check import Figure, NotMeasured
from .common import MOE, UNRECORDED, points

_DOC = "docs/moe/README.md"


def _seeds(arm: str, path: str) -> tuple[str, ...]:
  """The key of `path` in each of `arm`'s seeds, 0 to 2: a row's three figures."""
  return tuple(f"arms/{arm}/{seed}/{path}" for seed in range(3))


def _percent(fraction: float) -> str:
  """0.0064 -> '0.64%'; none is '0'."""
  return f"{100 * fraction:.2f}%" if fraction else "0"


def _same_as_routing(seeds: list[dict]) -> str:
  """'the same' where every seed's `router_differs` is its `routing_differs`, else each seed's."""
  router = [seed["mean"]["router_differs"] for seed in seeds]
  same = router == [seed["mean"]["routing_differs"] for seed in seeds]
  return "the same" if same else " / ".join(map(_percent, router))


def _e4(value: float) -> str:
  """0.00089 -> '8.9', for '8.9 e-4'."""
  return f"{value * 1e4:.1f}"


def _sft_and_rl(arm: str) -> tuple[str, ...]:
  """'sft → rl' of each seed of `arm`: two keys a seed."""
  return tuple(key for seed in range(3) for key in (f"arms/{arm}/{seed}/sft_accuracy",
                                                     f"arms/{arm}/{seed}/rl_accuracy"))


def _cuts(arms: dict) -> list[float]:
  """What replay takes off each seed's mean mismatch, as a fraction of it without."""
  return [1 - on["mean"]["engine_logp_diff_mean"] / off["mean"]["engine_logp_diff_mean"]
          for off, on in zip(arms["off"], arms["on"])]


def _least_cut(arms: dict) -> str:
  return f"{100 * min(_cuts(arms)):.0f}"


def _most_cut(arms: dict) -> str:
  return f"{100 * max(_cuts(arms)):.0f}"


def _largest(seeds: list[dict]) -> list[float]:
  """Each seed's largest per-token mismatch of any step."""
  return [seed["max"]["engine_logp_diff_max"] for seed in seeds]


def _least_largest(seeds: list[dict]) -> str:
  return f"{min(_largest(seeds)):.1f}"


def _most_largest(seeds: list[dict]) -> str:
  return f"{max(_largest(seeds)):.1f}"


def _most_largest_replayed(seeds: list[dict]) -> str:
  return f"{max(_largest(seeds)):.2f}"


def _gain(seed: dict) -> str:
  """A seed's held-out accuracy after RL less after SFT, in points."""
  return points(seed["rl_accuracy"] - seed["sft_accuracy"])


_ROW = "| {} / {} / {} | {} / {} / {} |"
FIGURES = (
    # The table: means over the 150 steps, then the largest of any step, then accuracy.
    Figure(_DOC, "(`routing_differs`) " + _ROW, MOE,
           _seeds("off", "mean/routing_differs") + _seeds("on", "mean/routing_differs"),
           _percent),
    Figure(_DOC, "(`router_differs`) | {} | {} / {} / {} |", MOE,
           ("arms/off",) + _seeds("on", "mean/router_differs"),
           (_same_as_routing, _percent, _percent, _percent)),
    Figure(_DOC, "(`engine_logp_diff_mean`) | {} / {} / {} e-4 | {} / {} / {} e-4 |", MOE,
           _seeds("off", "mean/engine_logp_diff_mean")
           + _seeds("on", "mean/engine_logp_diff_mean"), _e4),
    Figure(_DOC, "(`engine_logp_diff_max`) " + _ROW, MOE,
           _seeds("off", "mean/engine_logp_diff_max") + _seeds("on", "mean/engine_logp_diff_max"),
           "{:.3f}"),
    Figure(_DOC, "| the largest of any step " + _ROW, MOE,
           _seeds("off", "max/engine_logp_diff_max") + _seeds("on", "max/engine_logp_diff_max"),
           "{:.2f}"),
    Figure(_DOC, "(256 problems) | {} → {} / {} → {} / {} → {} | "
           "{} → {} / {} → {} / {} → {} |", MOE, _sft_and_rl("off") + _sft_and_rl("on"),
           "{:.3f}"),
    # What it shows
    Figure(_DOC, "replay takes {} to {}% off it", MOE, ("arms", "arms"), (_least_cut, _most_cut)),
    Figure(_DOC, "changes its log-prob by {} to {}.", MOE, ("arms/off", "arms/off"),
           (_least_largest, _most_largest)),
    Figure(_DOC, "no step's largest gap passes {}.", MOE, ("arms/on",), _most_largest_replayed),
    Figure(_DOC, "with replay on**, {}, {} and {} points held-out", MOE,
           tuple(f"arms/on/{seed}" for seed in range(3)), _gain),
)

NOT_MEASURED = (
    NotMeasured(_DOC, "(about 25 minutes on the 2-core CPU, one run a core, 8 minutes a run, "
                "timed by hand at commit f01d313 and not recorded)", UNRECORDED),
)
GENERATED = ()
