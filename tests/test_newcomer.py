"""What a newcomer does: a new loss (one function and one registration) and a new rollout
source (one small class) in a module of their own, trained through experiments/run.py by a gin
file that imports that module. Nothing in the library changes."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE = '''
"""A newcomer's experiment: a loss and a rollout source of their own."""
import dataclasses
from typing import Any

import gin

from rl import losses, sources


@losses.register("reinforce_anchored", advantage="mean_baseline", aggregation="token-mean")
def reinforce_anchored(logp, batch, *, anchor: float = 0.1):
  """REINFORCE, plus anchor * (logp - old_logp)^2 keeping the policy near the sampler."""
  return -batch.advantages * logp + anchor * (logp - batch.old_logp) ** 2, {}


@gin.configurable
@dataclasses.dataclass
class BestOf(sources.Source):
  """Keeps the `keep` best samples of every group of `inner`: correct first, then shorter."""
  inner: Any = dataclasses.field(default_factory=sources.Lockstep)
  keep: int = 2

  def init(self, context):
    return self.inner.init(context)

  def next(self, context, state, step, gate=sources.no_gate):
    made, state = self.inner.next(context, state, step, gate)
    groups = {}
    for t in made.trajectories:
      groups.setdefault(t.group, []).append(t)
    best = [sorted(g, key=lambda t: (not t.correct, t.policy_count))[:self.keep]
            for g in groups.values()]
    kept = [t for g in best for t in g]
    return sources.Made(kept, {**made.metrics, "best_of_kept": len(kept)}), state
'''

CONFIG = """
import newcomer_experiment

include '{root}/experiments/configs/quickstart.gin'
include '{root}/experiments/configs/tiny.gin'

Objective.loss = 'reinforce_anchored'
Objective.loss_hparams = {{'anchor': 0.05, 'aggregation': 'seq-mean-token-mean'}}
train.rollouts = @BestOf()
BestOf.keep = 2
Hooks.progress = False
"""


def test_a_new_loss_and_a_new_rollout_source_train_through_run_py(tmp_path):
  (tmp_path / "newcomer_experiment.py").write_text(MODULE)
  config = tmp_path / "newcomer.gin"
  config.write_text(CONFIG.format(root=ROOT))
  run_dir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments/run.py"), "--gin", str(config),
       "--run_dir", str(run_dir)], capture_output=True, text=True, cwd=ROOT, timeout=600,
      env=dict(os.environ, PYTHONPATH=str(tmp_path)))
  assert result.returncode == 0, result.stderr[-3000:]
  operative = open(run_dir / "config.gin").read()
  assert "Objective.loss = 'reinforce_anchored'" in operative
  assert "train.rollouts = @BestOf()" in operative
  records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][1:]
  assert [r["step"] for r in records] == [1, 2, 3]
  for r in records:  # tiny.gin: 4 prompts of 4 samples, the best 2 of each kept and trained
    assert r["best_of_kept"] == 8 and r["groups_trained"] == 4
    assert r["loss"] == r["loss"] and r["grad_norm"] > 0  # the new loss ran, not NaN
