"""rl/monitors.py: each monitor fires on its failure and stays quiet on a noisy healthy run;
the chain composes; `Hooks.stop_on` stops a real tiny run after a checkpoint, and it resumes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rl import ConfigError, monitors, trainer
from rl.tasks.arithmetic import Arithmetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONSET = 100  # the step where a failing trajectory starts to fail


def healthy(seed: int = 0, steps: int = 200, eval_every: int = 10) -> list[dict]:
  """metrics.jsonl of a run that learns, with the noise of real runs: reward and held-out
  accuracy rise along a logistic curve (held-out noise of 256 problems), entropy falls by
  half, lengths drift up by a quarter, the engine mismatch wobbles around bf16's 0.01, a
  mixture's busiest expert around 1.4 x its fair share; three wild steps and one bad
  evaluation on top."""
  rng = np.random.default_rng(seed)
  experts_rng = np.random.default_rng(seed + 1000)  # apart: the other draws stay as they were
  records = [{"step": 0, "eval_accuracy": 0.5, "eval_length": 30.0}]
  for step in range(1, steps + 1):
    t = step / steps
    learned = 1 / (1 + np.exp(-8 * (t - 0.3)))
    reward = float(np.clip(0.3 + 0.5 * learned + rng.normal(0, 0.05), 0, 1))
    r = {"step": step, "reward": reward, "accuracy": reward,
         "entropy": float((0.45 + 0.45 * np.exp(-3 * t)) * rng.lognormal(0, 0.1)),
         "completion_length": float((120 + 30 * t) * rng.lognormal(0, 0.08)),
         "truncated": float(np.clip(0.03 + rng.normal(0, 0.02), 0, 1)),
         "engine_logp_diff_mean": float(0.01 * rng.lognormal(0, 0.2)), "loss": 0.1,
         "expert_load_max": float(1.4 * experts_rng.lognormal(0, 0.1))}
    if step in (40, 90, 150):  # one wild step: no trend
      r.update(entropy=3 * r["entropy"], completion_length=2.5 * r["completion_length"],
               engine_logp_diff_mean=10 * r["engine_logp_diff_mean"], truncated=0.9,
               reward=1.0, expert_load_max=3 * r["expert_load_max"])
    if step % eval_every == 0:
      mean_at_8 = float(np.clip(0.45 + 0.3 * learned + rng.normal(0, 0.02), 0, 1))
      r.update({"eval_accuracy": float(np.clip(0.5 + 0.3 * learned + rng.normal(0, 0.03), 0, 1)),
                "eval_length": 30.0, "eval_pass@1": mean_at_8, "eval_mean@1": mean_at_8,
                "eval_pass@8": float(np.clip(0.85 + 0.07 * learned + rng.normal(0, 0.02), 0, 1)),
                "eval_mean@8": mean_at_8})
      if step == 120:  # one bad evaluation
        r["eval_accuracy"] -= 0.15
        r["eval_pass@8"] -= 0.08
    records.append(r)
  return records


def _after_onset(records, change):
  """`change(record, s)` applied from ONSET on, s going 0 -> 1 over the last steps."""
  last = records[-1]["step"]
  for r in records:
    if r["step"] >= ONSET:
      change(r, (r["step"] - ONSET) / (last - ONSET))
  return records


FAILURES = {
    "entropy_collapse": lambda r, s: r.update(entropy=r["entropy"] * (1 - 0.97 * min(1, 3 * s))),
    "entropy_spike": lambda r, s: r.update(entropy=r["entropy"] * (1 if s < 0.5 else 3)),
    "length_collapse": lambda r, s: r.update(
        completion_length=r["completion_length"] * (1 - 0.9 * min(1, 2 * s))),
    "length_runaway": lambda r, s: r.update(
        completion_length=r["completion_length"] * (1 + 3 * s),
        truncated=min(1.0, r["truncated"] + 1.2 * s)),
    "pass_at_k_narrowing": lambda r, s: "eval_pass@8" in r and r.update({
        "eval_pass@8": r["eval_pass@8"] - 0.2 * s, "eval_mean@8": r["eval_mean@8"] + 0.1 * s}),
    "logp_mismatch": lambda r, s: r.update(
        engine_logp_diff_mean=r["engine_logp_diff_mean"] * (1 + 9 * s)),
    "reward_hacking": lambda r, s: r.update(reward=min(1.0, r["reward"] + 0.2 * s)) or (
        "eval_accuracy" in r and r.update(eval_accuracy=r["eval_accuracy"] - 0.3 * s)),
    "expert_collapse": lambda r, s: r.update(
        expert_load_max=r["expert_load_max"] * (1 + 2 * min(1, 3 * s))),
}


def _alerts(monitor, records):
  state, fired = monitor.init(), []
  for r in records:
    alerts, state = monitor.update(r, state)
    fired += [(r["step"], a) for a in alerts]
  return fired


def test_every_monitor_has_a_failure_here():
  assert set(FAILURES) == set(monitors.MONITORS) == set(monitors.defaults())


@pytest.mark.parametrize("seed", range(20))
def test_defaults_stay_quiet_on_a_noisy_healthy_run(seed):
  assert _alerts(monitors.named_chain(monitors.defaults()), healthy(seed)) == []


@pytest.mark.parametrize("name", sorted(monitors.MONITORS))
@pytest.mark.parametrize("seed", range(3))
def test_each_monitor_fires_on_its_failure(name, seed):
  records = _after_onset(healthy(seed), FAILURES[name])
  fired = _alerts(monitors.named_chain(monitors.defaults()), records)
  mine = [(step, a) for step, a in fired if a.monitor == name]
  assert len(mine) == 1, fired  # fires once while the failure lasts
  step, alert = mine[0]
  assert step > ONSET, fired
  assert alert.message  # says what it saw
  # The monitor alone, outside a chain, fires under its own name at the same step.
  assert [(s, a.monitor) for s, a in _alerts(monitors.MONITORS[name](), records)] == [
      (step, name)]


def test_a_monitor_fires_again_only_after_its_rule_cleared():
  """Edge-triggered: the rule holding for many steps is one alert; clearing and failing
  again is a second."""
  entropy = [1.0] * 10 + [0.01] * 10 + [1.0] * 10 + [0.01] * 10
  records = [{"step": i + 1, "entropy": e} for i, e in enumerate(entropy)]
  fired = _alerts(monitors.entropy_collapse(), records)
  assert [step for step, _ in fired] == [13, 33]  # the median of 5 turns on the 3rd step


def test_missing_and_non_finite_metrics_leave_the_state_as_it_was():
  monitor = monitors.entropy_spike()
  state = monitor.init()
  _, state = monitor.update({"step": 1, "entropy": 0.5}, state)
  for record in ({"step": 2}, {"step": 3, "entropy": float("nan")},
                 {"step": 4, "entropy": float("inf")}, {"step": 5, "entropy": "n/a"}):
    alerts, new_state = monitor.update(record, state)
    assert alerts == [] and new_state == state


def test_named_chain_keys_state_and_alerts_by_name():
  """Two instances of one monitor with different thresholds, under their own names: the
  chain's state holds each one's state as it would be alone, and each alert its key."""
  records = _after_onset(healthy(0), FAILURES["entropy_collapse"])
  chain = monitors.named_chain({"early": monitors.entropy_collapse(fraction=0.5),
                                "late": monitors.entropy_collapse(fraction=0.1),
                                "length": monitors.length_runaway()})
  fired = _alerts(chain, records)
  assert [a.monitor for _, a in fired] == ["early", "late"]
  early, late = fired[0][0], fired[1][0]
  assert ONSET < early < late
  state, alone = chain.init(), monitors.entropy_collapse(fraction=0.5)
  alone_state = alone.init()
  for r in records:
    _, state = chain.update(r, state)
    _, alone_state = alone.update(r, alone_state)
  assert set(state) == {"early", "late", "length"}
  assert state["early"] == alone_state
  json.dumps(state)  # plain numbers and tuples: readable, and cheap to rebuild by replay


def test_thresholds_are_checked():
  with pytest.raises(ValueError, match="entropy_spike: window=0 must be >= 1"):
    monitors.entropy_spike(window=0)


def test_unknown_stop_name_fails_before_anything_runs(tmp_path):
  with pytest.raises(ConfigError, match=r"Hooks.stop_on names \['entropy_colapse'\].*"
                                        r"entropy_collapse"):
    trainer.train(str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=50, num_test=20),
                  model=lambda vocab: None,
                  hooks=trainer.Hooks(stop_on=["entropy_colapse"], progress=False))
  assert not os.path.exists(tmp_path / "run")


def _run(*args):
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments/run.py"),
       "--gin", os.path.join(ROOT, "experiments/configs/quickstart.gin"),
       "--gin", os.path.join(ROOT, "experiments/configs/tiny.gin"),
       "--gin_param", "Hooks.progress = False", "--gin_param", "RLConfig.num_steps = 4",
       "--gin_param", "Hooks.checkpoint_every = 10", *args],
      capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_stop_on_saves_a_checkpoint_stops_and_resumes(tmp_path):
  """A threshold no run can pass (entropy below twice its start: at once) and a stop on it
  through gin: the run saves the step's checkpoint (checkpoint_every is 10), says why in
  summary.json, and a second call resumes and runs to the end (the monitor has fired)."""
  run_dir = str(tmp_path / "run")
  bindings = ["--run_dir", run_dir,
              "--gin_param", "Hooks.monitors = {'collapse': @entropy_collapse()}",
              "--gin_param", "entropy_collapse.fraction = 2.0",
              "--gin_param", "entropy_collapse.window = 1",
              "--gin_param", "Hooks.stop_on = ['collapse']"]
  first = _run(*bindings)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "warning [collapse] at RL step 1: median entropy of the last 1 steps" in first.stdout
  assert "stopped by monitor collapse at RL step 1" in first.stdout
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  assert summary["steps"] == 1
  assert summary["stopped"]["monitor"] == "collapse" and summary["stopped"]["step"] == 1
  assert "< 2 x" in summary["stopped"]["message"]
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["0", "1"]
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1]
  assert [w["monitor"] for w in records[1]["warnings"]] == ["collapse"]

  again = _run(*bindings)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resuming from" in again.stdout and "at RL step 1" in again.stdout
  assert "stopped by monitor" not in again.stdout
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  assert summary["steps"] == 4 and "stopped" not in summary
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  assert not any("warnings" in r for r in records[2:])
