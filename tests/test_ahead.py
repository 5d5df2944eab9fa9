"""Rollouts ahead of the trainer (Ahead.max_staleness): the same steps as lockstep when the
weights do not move, no trained token older than the bound, and an engine that fails while
the trainer steps is a clear error that leaves the last checkpoint whole."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config
from rl import ConfigError, sources, trainer
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rollouts.jax_engine import JaxEngine
from rollouts.sglang import ServerError
from rollouts.sglang_engine import local_engine
from tests import helpers
from tests.test_rl import PickADigit, digit_model  # noqa: F401 - the fixture

TIMINGS = ("generate_s", "verify_s", "score_s", "pack_s", "train_s", "weight_sync_s",
           "trainer_idle_s", "engine_idle_s")


def ahead_steps(tokenizer, digit_model, *, max_staleness: int, learning_rate: float,
                engine=None, weight_sync_every: int = 1):
  """The RL steps of PickADigit on `engine` (default: an embedded one), a generator."""
  cfg, params = digit_model
  rl = RLConfig(prompts_per_step=2, samples_per_prompt=8, max_new_tokens=4, seq_len=16,
                weight_sync_every=weight_sync_every, learning_rate=learning_rate)
  start = jax.tree.map(jnp.copy, params)  # the donating step must not take the fixture's
  rollouts = sources.Ahead(max_staleness=max_staleness) if max_staleness else sources.Lockstep()
  steps, _ = helpers.steps(start, cfg, engine=engine or JaxEngine(cfg, start),
                           task=PickADigit(4), tokenizer=tokenizer, loss="grpo", config=rl,
                           rollouts=rollouts, donate=True,
                           ref_params=params)  # grpo's KL to the reference
  return steps


def run_steps(tokenizer, digit_model, *, max_staleness: int, learning_rate: float, steps: int):
  records = ahead_steps(tokenizer, digit_model, max_staleness=max_staleness,
                        learning_rate=learning_rate)
  out = [next(records) for _ in range(steps)]
  records.close()  # stops the thread making rollouts ahead
  return out


def test_ahead_makes_the_same_steps_as_lockstep_when_the_weights_stay(tokenizer, digit_model):
  """With a learning rate of 0 every version of the weights is the same: rollouts made
  ahead then draw the same prompts, tokens and rewards as in lockstep, and the rollout-side
  state (rng, prompt statistics, sampler) ends the same."""
  lockstep = run_steps(tokenizer, digit_model, max_staleness=0, learning_rate=0.0, steps=4)
  ahead = run_steps(tokenizer, digit_model, max_staleness=1, learning_rate=0.0, steps=4)
  for a, b in zip(lockstep, ahead):
    assert a.metrics.keys() == b.metrics.keys()
    assert set(TIMINGS) <= set(a.metrics)
    for key in a.metrics:
      if not key.endswith("_s") and key != "staleness_max":
        np.testing.assert_allclose(b.metrics[key], a.metrics[key], rtol=1e-6, err_msg=key)
    assert [t.token_ids for t in a.trajectories] == [t.token_ids for t in b.trajectories]
  assert [r.metrics["staleness_max"] for r in lockstep] == [0, 0, 0, 0]
  end_a, end_b = lockstep[-1].state, ahead[-1].state
  jax.tree.map(np.testing.assert_array_equal,
               (end_a.rollout.rng, end_a.rollout.prompt_stats, end_a.step),
               (end_b.rollout.rng, end_b.rollout.prompt_stats, end_b.step))


def check_staleness(records, max_staleness: int):
  for record in records:
    trained_at = record.step - 1  # the version of the params this step updated
    versions = np.concatenate([t.versions for t in record.trajectories])
    assert versions.min() >= trained_at - max_staleness, (record.step, versions)
    assert versions.max() <= trained_at
    assert record.metrics["staleness_max"] == trained_at - versions.min()
  # The engine really ran ahead: some step trained on tokens of older weights.
  assert max(r.metrics["staleness_max"] for r in records) >= 1


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_token_is_older_than_max_staleness(tokenizer, digit_model, max_staleness):
  check_staleness(run_steps(tokenizer, digit_model, max_staleness=max_staleness,
                            learning_rate=2e-3, steps=6), max_staleness)


def test_ahead_on_a_server_keeps_the_bound_and_names_the_server_when_it_dies(
    tokenizer, digit_model, tmp_path):
  """Rollouts ahead of the trainer from a server process: its weight syncs let the requests
  in flight finish (no token older than the bound), and once the server is killed while
  the trainer steps, the next step is an error naming the server."""
  cfg, params = digit_model
  engine = local_engine(cfg, params, 0, weights_dir=str(tmp_path))
  steps = ahead_steps(tokenizer, digit_model, max_staleness=1, learning_rate=2e-3,
                      engine=engine)
  try:
    check_staleness([next(steps) for _ in range(5)], 1)
    engine.processes[0].kill()
    url = engine.client.urls[0]
    # Whichever meets the dead server first says so: the thread making rollouts ahead
    # (RolloutsFailed) or the trainer's weight sync (ServerError).
    with pytest.raises((sources.RolloutsFailed, ServerError), match=re.escape(url)):
      for _ in range(3):  # the step in the making may have finished before the kill
        next(steps)
  finally:
    steps.close()
    engine.close()


class FailingEngine(JaxEngine):
  """The embedded engine, failing at its `fail_at`-th generate call (a crashed engine)."""

  def __init__(self, *args, fail_at: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls, self.fail_at = 0, fail_at

  def generate(self, *args, **kwargs):
    self.calls += 1
    if self.calls == self.fail_at:
      raise RuntimeError("engine device lost")
    return super().generate(*args, **kwargs)


@pytest.mark.slow
def test_an_engine_failing_ahead_of_the_trainer_is_a_clear_error(tmp_path):
  run_dir = str(tmp_path / "run")
  with pytest.raises(sources.RolloutsFailed,
                     match=r"rollouts for RL step 4, made ahead of the trainer, failed: "
                           r"RuntimeError: engine device lost"):
    trainer.train(run_dir, task=Arithmetic(digits=1, num_train=500, num_test=50),
                  model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
                  rl=RLConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16,
                              seq_len=32, num_steps=6),
                  rollouts=sources.Ahead(max_staleness=1),
                  # The held-out evaluation after the warm start is generate call 1 (on the
                  # rollout engine), step k's rollouts call k + 1.
                  engine=lambda cfg, params, version: FailingEngine(
                      cfg, params, version=version, fail_at=5),
                  start=trainer.WarmStart(steps=5, batch_size=16),
                  hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16),
                                      checkpoint_every=1, progress=False))
  checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"))
  # Steps 1 to 3 trained before step 4's rollouts failed; step 3's checkpoint is whole.
  assert checkpoints.latest_step() == 3
  params = checkpoints.restore_params()
  checkpoints.close()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_weight_sync_every_n_steps_makes_rollouts_stale_by_the_schedule(tokenizer, digit_model):
  """RLConfig.weight_sync_every = 3: step t's rollouts come from the weights of version
  t - (t mod 3), in lockstep, whatever the timing; the weights still learn."""
  steps = ahead_steps(tokenizer, digit_model, max_staleness=0, learning_rate=2e-3,
                      weight_sync_every=3)
  records = [next(steps) for _ in range(7)]
  for record in records:
    trained_at = record.step - 1
    versions = np.concatenate([t.versions for t in record.trajectories])
    assert set(versions.tolist()) == {trained_at - trained_at % 3}, (record.step, versions)
  assert [r.metrics["staleness_max"] for r in records] == [0, 1, 2, 0, 1, 2, 0]
  assert records[-1].metrics["weight_sync_s"] >= 0


def test_weight_sync_every_is_checked(tmp_path):
  for rl, rollouts, message in [
      (RLConfig(weight_sync_every=0), None, "weight_sync_every=0 must be >= 1"),
      (RLConfig(weight_sync_every=2), sources.Ahead(max_staleness=1), "lockstep only")]:
    with pytest.raises(ConfigError, match=message):
      trainer.train(run_dir=str(tmp_path / "run"), task=Arithmetic(num_train=64, num_test=8),
                    model=config.tiny, rl=dataclasses.replace(rl, num_steps=1),
                    rollouts=rollouts,
                    hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=8),
                                        progress=False))
