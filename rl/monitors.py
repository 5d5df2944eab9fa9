"""Reasoning-collapse monitors: `(init, update)` pairs over a run's per-step metrics.

Owns the rules that read one RL step's metrics record (the dict `rl.trainer.train` writes to
metrics.jsonl) and say when the run shows a known way of failing. It does not own what
happens then: `train` shows each alert above the progress bar, records it in that step's
`warnings`, and stops the run (after a checkpoint) for the names in its `stop_on`.

A monitor is `Monitor(init, update)`, `update(metrics, state) -> (alerts, state)`: `metrics`
is one step's record, `state` a pytree of Python numbers that the caller threads through. A
metric missing from the record (the held-out ones between evaluations) or not finite leaves
the state as it was. `named_chain` composes monitors, keys their state by name and gives
each alert its member's name. The state is a function of the records alone, so `train`
rebuilds it on resume by replaying metrics.jsonl.

Smoothing: every rule compares medians over `window` values (steps, or evaluations for the
held-out metrics), never one value, so one noisy step or evaluation cannot fire a monitor.
A monitor fires when its rule starts to hold, and again only after the rule has not held
for `window` checks in a row: a run resumed after a stop goes on unless the failure clears
and comes back.

The rules, with their defaults ("first window": the run's first `window` values):

  entropy_collapse     median `entropy` of the last 5 steps < 0.1 x its median over the
                       first window
  entropy_spike        median `entropy` of the last 5 steps > 2 x its moving average over the
                       steps before them (half-life 20 steps)
  length_collapse      median `completion_length` of the last 5 steps < 0.3 x the first
                       window's
  length_runaway       that median > 2 x the first window's, or the median `truncated`
                       fraction of the last 5 steps > 0.5
  pass_at_k_narrowing  median `eval_pass@k` (largest k) of the last 3 evaluations 0.08 below
                       its best, while `eval_mean@k` is 0.02 above its value at that best
  logp_mismatch        median `engine_logp_diff_mean` of the last 5 steps > 3 x the first
                       window's and > 1e-3 nats per token
  reward_hacking       median `eval_accuracy` of the last 3 evaluations 0.08 below its best,
                       while the median train `reward` of the last 5 steps is 0.02 above its
                       value at that best
  expert_collapse      median `expert_load_max` (a mixture of experts: the busiest expert's
                       share of its layer's assignments times their number) of the last 5
                       steps > 2 x the first window's and > 2

The defaults stay quiet on the noisy healthy runs of tests/test_monitors.py (held-out noise
of 256 problems, wild single steps, one bad evaluation; over 500 of them only
reward_hacking fired, on 1%) and fire on each failure within a few steps or evaluations.
"""

import math
import statistics
from typing import Any, Callable, Mapping, NamedTuple, Optional


class Alert(NamedTuple):
  """A monitor's warning: the name it fired under and what it saw."""
  monitor: str
  message: str


class Monitor(NamedTuple):
  init: Callable[[], Any]
  update: Callable[[Mapping[str, Any], Any], tuple[list[Alert], Any]]


def named_chain(monitors: Mapping[str, Monitor]) -> Monitor:
  """Update every monitor on each record, in (insertion) order; the state is a dict keyed by
  the same names, and each alert carries the name of the monitor that raised it."""
  named = list(monitors.items())

  def init():
    return {name: m.init() for name, m in named}

  def update(metrics, state):
    alerts, new_state = [], {}
    for name, m in named:
      fired, new_state[name] = m.update(metrics, state[name])
      alerts += [alert._replace(monitor=name) for alert in fired]
    return alerts, new_state

  return Monitor(init, update)


# ----------------------------------------------------------------------------- helpers

def _value(metrics: Mapping[str, Any], key: str) -> Optional[float]:
  value = metrics.get(key)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return None
  return float(value)


def _check(name: str, **windows: float) -> None:
  for arg, value in windows.items():
    if value < 1:
      raise ValueError(f"monitor {name}: {arg}={value} must be >= 1")


def _push(values: tuple, value: float, window: int) -> tuple:
  return (*values, value)[-window:]


def _track(track: dict, value: float, window: int) -> dict:
  """The last `window` values, and `first`: the median of the run's first `window` values."""
  recent = _push(track["recent"], value, window)
  first = track["first"]
  if first is None and len(recent) == window:
    first = statistics.median(recent)
  return {"recent": recent, "first": first}


_EMPTY_TRACK = {"recent": (), "first": None}
_QUIET = {"active": False, "quiet": 0}


def _fire(name: str, state: dict, message: Optional[str], window: int
          ) -> tuple[list[Alert], dict]:
  """An alert when the rule starts to hold (a message); none while it holds, nor until it
  has not held for `window` checks in a row (a rule near its threshold flickers)."""
  if message is not None:
    return [] if state["active"] else [Alert(name, message)], {**state, "active": True,
                                                                "quiet": 0}
  quiet = state["quiet"] + 1
  return [], {**state, "active": state["active"] and quiet < window, "quiet": quiet}


def _against_first(name: str, key: str, window: int, compare: str, ratio: float, *,
                   floor: float = -math.inf) -> Monitor:
  """Fires when the median of `key` over the last `window` steps is below (compare "<") or
  above (">", and above `floor`) `ratio` times its median over the first window."""
  _check(name, window=window)

  def init():
    return {"track": _EMPTY_TRACK, **_QUIET}

  def update(metrics, state):
    value = _value(metrics, key)
    if value is None:
      return [], state
    track = _track(state["track"], value, window)
    level, first = statistics.median(track["recent"]), track["first"]
    message = None
    if first is not None and (level < ratio * first if compare == "<" else
                              level > max(ratio * first, floor)):
      message = (f"median {key} of the last {window} steps {level:.4g} {compare} {ratio:g} x "
                 f"{first:.4g} (its median over the first {window})")
      if compare == ">" and floor > -math.inf:
        message += f" and > {floor:g}"
    return _fire(name, {**state, "track": track}, message, window)

  return Monitor(init, update)


def _diverging(name: str, read: Callable, *, window: int, rising_window: int,
               min_drop: float, min_rise: float) -> Monitor:
  """Fires when the median of a held-out metric over its last `window` evaluations is
  `min_drop` below its best such median so far, while the median of another metric over its
  last `rising_window` values is `min_rise` above what it was at that best.
  `read(metrics) -> ((label, value), (label, value))`: the held-out metric, then the other;
  a value is None where the record lacks it."""
  _check(name, window=window, rising_window=rising_window)

  def init():
    return {"falling": (), "rising": (), "best": None, "rising_at_best": None, **_QUIET}

  def update(metrics, state):
    (falling_name, falling), (rising_name, rising) = read(metrics)
    if rising is not None:
      state = {**state, "rising": _push(state["rising"], rising, rising_window)}
    if falling is None:
      return [], state
    state = {**state, "falling": _push(state["falling"], falling, window)}
    if len(state["falling"]) < window:
      return [], state
    level = statistics.median(state["falling"])
    rise = statistics.median(state["rising"]) if state["rising"] else None
    if state["best"] is None or level > state["best"]:
      state = {**state, "best": level, "rising_at_best": rise}
    elif state["rising_at_best"] is None:  # the best came before any value of the other
      state = {**state, "rising_at_best": rise}
    best, rise_at_best = state["best"], state["rising_at_best"]
    message = None
    if (rise is not None and rise_at_best is not None and level < best - min_drop
        and rise > rise_at_best + min_rise):
      message = (f"median {falling_name} of the last {window} evaluations {level:.3f}, "
                 f"{best - level:.3f} below its best {best:.3f}, while {rising_name} rose "
                 f"from {rise_at_best:.3f} to {rise:.3f}")
    return _fire(name, state, message, window)

  return Monitor(init, update)


# ----------------------------------------------------------------------------- monitors

def entropy_collapse(*, fraction: float = 0.1, window: int = 5) -> Monitor:
  """Fires when the median `entropy` (the policy's mean per-token entropy on trained tokens,
  nats) of the last `window` steps falls below `fraction` x its median over the run's first
  `window` steps: the policy stopped exploring, and performance then plateaus (Cui et al.
  2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models")."""
  return _against_first("entropy_collapse", "entropy", window, "<", fraction)


def entropy_spike(*, factor: float = 2.0, window: int = 5, halflife: float = 20.0) -> Monitor:
  """Fires when the median `entropy` of the last `window` steps exceeds `factor` x its
  exponential moving average over the steps before them (half-life `halflife` steps): the
  policy suddenly spreads out, as when updates destabilise it and it samples garbage
  tokens. The average leaves the last `window` steps out, so a spike does not raise its
  own baseline."""
  _check("entropy_spike", window=window, halflife=halflife)
  decay = 0.5 ** (1.0 / halflife)

  def init():
    return {"recent": (), "average": None, **_QUIET}

  def update(metrics, state):
    value = _value(metrics, "entropy")
    if value is None:
      return [], state
    recent, average = state["recent"], state["average"]
    if len(recent) == window:  # the oldest value leaves the window for the average
      average = recent[0] if average is None else decay * average + (1 - decay) * recent[0]
    recent = _push(recent, value, window)
    level, message = statistics.median(recent), None
    if average is not None and level > factor * average:
      message = (f"median entropy of the last {window} steps {level:.4g} > {factor:g} x "
                 f"{average:.4g} (its moving average before them, half-life {halflife:g} "
                 "steps)")
    return _fire("entropy_spike", {**state, "recent": recent, "average": average}, message,
                 window)

  return Monitor(init, update)


def length_collapse(*, fraction: float = 0.3, window: int = 5) -> Monitor:
  """Fires when the median `completion_length` (tokens) of the last `window` steps falls
  below `fraction` x its median over the run's first `window` steps: the policy stopped
  reasoning at length (expected, and then harmless, under a strong length penalty)."""
  return _against_first("length_collapse", "completion_length", window, "<", fraction)


def length_runaway(*, factor: float = 2.0, max_truncated: float = 0.5,
                   window: int = 5) -> Monitor:
  """Fires when the median `completion_length` of the last `window` steps exceeds `factor` x
  its median over the run's first `window` steps, or the median `truncated` fraction (cut
  at max_new_tokens) of the last `window` steps exceeds `max_truncated`: lengths grow
  without bound, often repetition (the second catches growth hidden by the length cap)."""
  _check("length_runaway", window=window)

  def init():
    return {"length": _EMPTY_TRACK, "truncated": (), **_QUIET}

  def update(metrics, state):
    length, truncated = _value(metrics, "completion_length"), _value(metrics, "truncated")
    if length is None or truncated is None:
      return [], state
    track = _track(state["length"], length, window)
    recent_truncated = _push(state["truncated"], truncated, window)
    level, first = statistics.median(track["recent"]), track["first"]
    cut = statistics.median(recent_truncated)
    message = None
    if first is not None and level > factor * first:
      message = (f"median completion_length of the last {window} steps {level:.4g} > "
                 f"{factor:g} x {first:.4g} (its median over the first {window})")
    elif len(recent_truncated) == window and cut > max_truncated:
      message = (f"median truncated fraction of the last {window} steps {cut:.3g} > "
                 f"{max_truncated:g}")
    return _fire("length_runaway", {**state, "length": track, "truncated": recent_truncated},
                 message, window)

  return Monitor(init, update)


def _largest_k(metrics: Mapping[str, Any]) -> Optional[int]:
  ks = [int(key.rsplit("@", 1)[1]) for key in metrics if key.startswith("eval_pass@")]
  ks = [k for k in ks if f"eval_mean@{k}" in metrics]
  return max(ks) if ks else None


def pass_at_k_narrowing(*, min_drop: float = 0.08, min_rise: float = 0.02,
                        window: int = 3) -> Monitor:
  """Fires when, at the largest k the sampled evaluation reports, the median `eval_pass@k`
  of the last `window` evaluations is `min_drop` below its best median so far while the
  median `eval_mean@k` is `min_rise` above its value at that best: RL sharpens the policy
  onto fewer solutions, so more problems are solved reliably and fewer at all (Yue et al.
  2025, "Does Reinforcement Learning Really Incentivize Reasoning Capacity in LLMs Beyond
  the Base Model?"). Silent unless train runs the sampled evaluation (`sampled_eval`)."""

  def read(metrics):
    k = _largest_k(metrics)
    if k is None:
      return (None, None), (None, None)
    return ((f"eval_pass@{k}", _value(metrics, f"eval_pass@{k}")),
            (f"eval_mean@{k}", _value(metrics, f"eval_mean@{k}")))

  return _diverging("pass_at_k_narrowing", read, window=window, rising_window=window,
                    min_drop=min_drop, min_rise=min_rise)


def logp_mismatch(*, factor: float = 3.0, floor: float = 1e-3, window: int = 5) -> Monitor:
  """Fires when the median `engine_logp_diff_mean` (mean |trainer - engine| log-prob per
  token, nats, before the step's first update) of the last `window` steps exceeds `factor`
  x its median over the run's first `window` steps and `floor`: the sampled tokens come
  from a policy drifting away from the one trained (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"); the floor keeps fp32 rounding
  (~1e-6 on the embedded engine) quiet."""
  return _against_first("logp_mismatch", "engine_logp_diff_mean", window, ">", factor,
                        floor=floor)


def reward_hacking(*, min_drop: float = 0.08, min_rise: float = 0.02, window: int = 3,
                   reward_window: int = 5) -> Monitor:
  """Fires when the median held-out `eval_accuracy` of the last `window` evaluations is
  `min_drop` below its best median so far while the median train `reward` of the last
  `reward_window` steps is `min_rise` above its value at that best: the policy earns more
  reward for less real skill (a verifier or reward transform it learned to exploit)."""
  reward = f"the median train reward of the last {reward_window} steps"
  read = lambda metrics: (("eval_accuracy", _value(metrics, "eval_accuracy")),
                          (reward, _value(metrics, "reward")))
  return _diverging("reward_hacking", read, window=window, rising_window=reward_window,
                    min_drop=min_drop, min_rise=min_rise)


def expert_collapse(*, factor: float = 2.0, floor: float = 2.0, window: int = 5) -> Monitor:
  """Fires when the median `expert_load_max` (the busiest expert's share of a layer's
  assignments times the number of experts, mean over layers: 1 when balanced, E / k when k
  experts take every token) of the last `window` steps exceeds `factor` x its median over
  the run's first `window` steps and `floor`: a few experts take the tokens and the others
  stop learning. Silent for dense models (no such metric)."""
  return _against_first("expert_collapse", "expert_load_max", window, ">", factor,
                        floor=floor)


MONITORS: dict[str, Callable[..., Monitor]] = {
    "entropy_collapse": entropy_collapse, "entropy_spike": entropy_spike,
    "length_collapse": length_collapse, "length_runaway": length_runaway,
    "pass_at_k_narrowing": pass_at_k_narrowing, "logp_mismatch": logp_mismatch,
    "reward_hacking": reward_hacking, "expert_collapse": expert_collapse,
}


def defaults() -> dict[str, Monitor]:
  """Every monitor with its default thresholds, keyed by its name: `train`'s default set."""
  return {name: make() for name, make in MONITORS.items()}
