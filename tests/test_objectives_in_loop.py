"""Every loss, reward chain and sampler runs in the quickstart loop, swapped by one binding."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config, transformer
from rl import ConfigError, distill, losses, sampling, sources, trainer
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
# What lets each swap show in two steps: every trajectory of a step in samples.jsonl, and
# eight training problems (among the default 20,000, reweighting the four that step 1 saw
# leaves step 2's draw as it is), which 200 warm-start steps learn by heart, some right and
# some sloppy: groups then differ in verdicts and lengths, and some problem is solved by
# every sample.
SHOWN = ("Hooks.samples_every = 1", "Hooks.samples = 16", "Arithmetic.num_train = 8",
         "WarmStart.steps = 200")
GROUP = 4  # tiny.gin's RLConfig.samples_per_prompt; its prompts_per_step is 4 too


@pytest.mark.slow
def test_one_binding_swaps_a_piece_of_the_quickstart(tmp_path):
  """One run with all three swaps (each one binding; one run keeps CI time down), each seen
  in what it changes, row by row in samples.jsonl: the rewards are k1.5's (correctness plus
  its length reward at weight 1) of each trajectory's verdict and length, not the
  quickstart's bare correctness; the advantages are DAPO's group-normalised ones, not the
  k1.5 loss's mean baseline; and step 2's problems are the prioritized draw after step 1's
  verdicts, not the uniform draw from the same key."""
  run_dir = tmp_path / "run"
  bindings = [arg for binding in BINDINGS + SHOWN for arg in ("--gin_param", binding)]
  result = subprocess.run(
      [sys.executable, "experiments/run.py", "--gin", "experiments/configs/quickstart.gin",
       "--gin", "experiments/configs/tiny.gin", "--run_dir", str(run_dir),
       "--gin_param", "Hooks.progress = False", "--gin_param", "RLConfig.num_steps = 2",
       *bindings],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  operative = open(run_dir / "config.gin").read()
  for binding in BINDINGS:
    assert binding.split(" = ")[1].strip("@'()") in operative, binding
  with open(run_dir / "samples.jsonl") as f:
    rows = [r for r in map(json.loads, f) if r["split"] == "train"]
  steps = {step: [r for r in rows if r["step"] == step] for step in (1, 2)}
  assert len(rows) == 32 and all(len(s) == 4 * GROUP for s in steps.values()), len(rows)

  # The k1.5 reward (arXiv 2501.12599 sec. 2.3.3) and DAPO's advantages, group by group
  # (rows are group-major: rl.samples.pick keeps all of a step's trajectories in order).
  length_rewarded = spread = 0
  for step_rows in steps.values():
    for start in range(0, len(step_rows), GROUP):
      group = step_rows[start:start + GROUP]
      assert len({r["prompt"] for r in group}) == 1, group
      correct = np.array([r["correct"] for r in group])
      length = np.array([r["length"] for r in group], np.float64)
      reward = np.array([r["reward"] for r in group])
      span = length.max() - length.min()
      lam = 0.5 - (length - length.min()) / span if span else np.zeros(GROUP)
      bonus = np.where(correct, lam, np.minimum(0.0, lam))
      np.testing.assert_allclose(reward, correct + bonus, atol=1e-6, err_msg=str(group))
      length_rewarded += np.any(bonus != 0)
      advantage = np.array([r["advantage"] for r in group])
      centred = reward - reward.mean()
      np.testing.assert_allclose(advantage, centred / (reward.std(ddof=1) + 1e-6), atol=1e-5,
                                 err_msg=str(group))
      spread += not np.allclose(advantage, centred, atol=1e-3)
  # Groups where each swap makes a difference: the length reward moved a reward, and the
  # normalised advantage is not the mean baseline.
  assert length_rewarded and spread, (length_rewarded, spread)
  with open(run_dir / "metrics.jsonl") as f:
    trained = [m for m in map(json.loads, f) if "loss" in m]
  assert len(trained) == 2 and not any("log_ratio_seq" in m for m in trained)  # k1.5's own

  # The prioritized draw (k1.5 sec. 2.3.4: weight 1 - pass rate): step 2's problems are
  # those drawn with step 1's verdicts counted. The loop's prompts are drawn from seed + 1
  # (rl.trainer; train.seed = 0): step 1's draw, the same under any sampler, checks that.
  task = Arithmetic(digits=1, operands=2, sloppy=0.6, filler=0, num_train=8)  # the run's
  context = lambda sampler: sources.Context(None, task, None, RLConfig(
      prompts_per_step=4, samples_per_prompt=GROUP), sampler)
  problems = lambda indices: [task.prompt(task.train[int(i)]) for i in indices]
  state = sources.init_state(context(sampling.uniform()), sources.Lockstep(), 1)
  first, _, state = sources.draw(context(sampling.uniform()), state, 0)
  assert problems(first) == [r["prompt"] for r in steps[1][::GROUP]]
  solved = [sum(r["correct"] for r in steps[1][g:g + GROUP])
            for g in range(0, len(steps[1]), GROUP)]
  state = state.replace(prompt_stats=state.prompt_stats.record(
      jnp.asarray(first), GROUP, jnp.asarray(solved), step=0))
  prioritized, uniform = (problems(sources.draw(context(sampler), state, 1)[0])
                          for sampler in (sampling.prioritized(), sampling.uniform()))
  assert [r["prompt"] for r in steps[2][::GROUP]] == prioritized != uniform, (
      prioritized, uniform, solved)
