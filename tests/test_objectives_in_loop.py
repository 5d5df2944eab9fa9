"""Every loss, reward chain and sampler runs in the quickstart loop, swapped by one binding."""

import json
import os
import subprocess
import sys

import jax
import pytest

from models import config, transformer
from rl import ConfigError, distill, losses, trainer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rollouts.jax_engine import JaxEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# tests/test_rl.py runs every registered loss through the loop until it solves a task; here
# the whole quickstart path (SFT, KL reference, eval, checkpoints) runs a few steps with every
# registered rollout loss.
@pytest.mark.slow
@pytest.mark.parametrize("name", losses.rollout_losses())
def test_three_quickstart_steps_with_every_rollout_loss(name, tmp_path):
  # A distillation loss gets a teacher: a second tiny model (random weights) that scores.
  teachers = None if not losses.get(name).teacher else lambda cfg: distill.Teachers(
      {"other": JaxEngine(cfg, transformer.init_params(cfg, jax.random.PRNGKey(7)))},
      {"*": "other"})
  summary = trainer.train(
      str(tmp_path / name), task=Arithmetic(digits=1, num_train=200, num_test=20),
      model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
      objective=trainer.Objective(loss=name, teachers=teachers),
      rl=RLConfig(prompts_per_step=4, samples_per_prompt=4, minibatches=2, max_new_tokens=16,
                  seq_len=32, num_steps=3),
      start=trainer.WarmStart(steps=5, batch_size=16),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), checkpoint_every=3,
                          progress=False))
  assert summary["steps"] == 3
  records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")][1:]
  assert [r["step"] for r in records] == [1, 2, 3]
  for r in records:
    for key in ("loss", "entropy", "ratio_mean", "kl_to_old", "logp_diff_max", "grad_norm"):
      assert key in r and r[key] == r[key], (key, r)  # present and not NaN
    if teachers is not None:
      assert r["teacher_share/other"] == 1.0 and r["student_teacher_kl"] == r["student_teacher_kl"]


def test_an_aggregation_the_loss_cannot_take_stops_the_run_before_it_starts(tmp_path):
  for hparams, message in (({"aggregation": "token-sum"}, "unknown aggregation 'token-sum'"),
                           ({"norm_length": 64}, "bind aggregation='seq-mean-token-sum-norm'")):
    with pytest.raises(ConfigError, match=f"loss 'ppo': .*{message}"):
      trainer.train(str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=20, num_test=4),
                    model=config.tiny,
                    objective=trainer.Objective(loss="ppo", loss_hparams=hparams),
                    hooks=trainer.Hooks(progress=False))
  assert not os.path.exists(tmp_path / "run")  # checked first: nothing written or compiled


BINDINGS = ("Objective.loss = 'dapo'", "Objective.reward = @rewards.k15()",
            "Objective.sampler = @sampling.prioritized()")


@pytest.mark.slow
def test_one_binding_swaps_a_piece_of_the_quickstart(tmp_path):
  # One run with all three swaps (each is one binding) keeps CI time down.
  bindings = [arg for binding in BINDINGS for arg in ("--gin_param", binding)]
  result = subprocess.run(
      [sys.executable, "experiments/run.py", "--gin", "experiments/configs/quickstart.gin",
       "--gin", "experiments/configs/tiny.gin", "--run_dir", str(tmp_path / "run"),
       "--gin_param", "Hooks.progress = False", "--gin_param", "RLConfig.num_steps = 2",
       *bindings],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  operative = open(tmp_path / "run" / "config.gin").read()
  for binding in BINDINGS:
    assert binding.split(" = ")[1].strip("@'()") in operative, binding
