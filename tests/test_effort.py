"""Reasoning effort as a trained budget (rl/effort.py, rewards.effort_budget / tightening):
the override rule by hand, budgets estimated from lengths by hand, the schedule, the task
wrapper, the per-level evaluation sweep on a tiny model, and the loop filling record ids."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import evaluation
from models import config, transformer
from rl import ConfigError, corrections, effort
from rl import eval as eval_lib
from rl import loop, rewards, sft, sources
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rl.types import Rollouts
from rollouts.jax_engine import JaxEngine
from tests import helpers
from tests.test_eval import HasOne


def _rollouts(lengths, records, correct=None, groups=None, reward=None):
  n = len(lengths)
  groups = [0] * n if groups is None else groups
  correct = [True] * n if correct is None else correct
  return Rollouts(group_ids=jnp.asarray(groups), correct=jnp.asarray(correct, bool),
                  lengths=jnp.asarray(lengths), truncated=jnp.zeros(n, bool),
                  well_formed=jnp.ones(n, bool),
                  reward=jnp.asarray(np.asarray(correct, np.float32) if reward is None
                                     else reward, jnp.float32),
                  loss_mask=jnp.ones(n, bool), num_groups=max(groups) + 1,
                  record_ids=jnp.asarray(records, jnp.int32))


def test_effort_budget_overrides_the_reward_exactly_over_budget():
  # Records 0, 1, 2: budgets 10, 20, 40 (given); rewards 1 (correct), 0 and 0.5 (shaped).
  t = rewards.effort_budget(levels=[0, 1, 2], budgets=[10.0, 20.0, 40.0], over_reward=-0.25)
  lengths = [9, 10, 11, 19, 20, 21, 40, 41]
  records = [0, 0, 0, 1, 1, 1, 2, 2]
  correct = [True, True, True, False, False, False, True, False]
  before = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5]
  out, state = t.update(_rollouts(lengths, records, correct, reward=before), t.init(), step=0)
  # Under or at the budget: unchanged; over it: -0.25, correct or not.
  np.testing.assert_array_equal(np.asarray(out.reward),
                                [1.0, 1.0, -0.25, 0.0, 0.0, -0.25, 0.5, -0.25])
  np.testing.assert_array_equal(np.asarray(out.loss_mask), [True] * 8)  # reward only
  np.testing.assert_array_equal(np.asarray(state["budget"]), [10.0, 20.0, 40.0])
  # The schedule multiplies every budget: x1.5 puts 11, 21 and 41 within theirs.
  loose = rewards.effort_budget(levels=[0, 1, 2], budgets=[10.0, 20.0, 40.0],
                                over_reward=-0.25, schedule=lambda step: 1.5)
  out, _ = loose.update(_rollouts(lengths, records, correct, reward=before), loose.init(),
                        step=0)
  np.testing.assert_array_equal(np.asarray(out.reward), before)
  # Under jit, as the other transforms.
  jitted = jax.jit(lambda r, s: t.update(r, s, step=3))
  out, _ = jitted(_rollouts(lengths, records, correct, reward=before), t.init())
  assert np.asarray(out.reward)[2] == -0.25


def test_budgets_estimated_from_lengths_match_a_hand_computation():
  # budget_from_lengths: linear-interpolated quantile times the multiplier.
  lengths = np.array([[10, 20, 30, 40], [8, 8, 8, 16]], np.float32)
  got = rewards.budget_from_lengths(lengths, [0.5, 2.0], quantile=0.75)
  # q = 0.75 of 4 sorted values: position 2.25 -> 30 + 0.25 * 10 = 32.5; 8 + 0.25 * 8 = 10.
  np.testing.assert_allclose(np.asarray(got), [32.5 * 0.5, 10.0 * 2.0])
  np.testing.assert_allclose(np.asarray(got), np.quantile(lengths, 0.75, axis=1) * [0.5, 2.0])

  # In the transform: record r's first group (unsorted, groups interleaved) fixes its budget.
  # Records 0..5 = problems 0..1 at levels low/high/max (multipliers 0.5, 1, 2).
  levels = effort.level_ids(effort.EffortTask(Arithmetic(num_train=2)))
  assert levels.tolist() == [0, 1, 2, 0, 1, 2]
  t = rewards.effort_budget(levels=levels, multipliers=(0.5, 1.0, 2.0), quantile=0.5,
                            budgets=[np.nan, np.nan, np.nan, np.nan, 7.0, np.nan])
  first = _rollouts(lengths=[30, 10, 5, 20, 40, 9], records=[1, 2, 1, 2, 4, 4],
                    groups=[0, 1, 0, 1, 2, 2])
  out, state = t.update(first, t.init(), step=0)
  budget = np.asarray(state["budget"])
  # Record 1 (high): median of {30, 5} = 17.5, x1; record 2 (max): median {10, 20} = 15, x2.
  np.testing.assert_allclose(budget[[1, 2, 4]], [17.5, 30.0, 7.0])  # 4 was given: kept
  assert np.isnan(budget[[0, 3, 5]]).all()  # never drawn
  np.testing.assert_array_equal(np.asarray(out.reward), [0, 1, 1, 1, 0, 0])  # 30 > 17.5 ...
  # Fixed from then on: a later group of record 1 does not move it.
  again, state = t.update(_rollouts([100, 100], [1, 1]), state, step=1)
  np.testing.assert_allclose(np.asarray(state["budget"])[1], 17.5)
  np.testing.assert_array_equal(np.asarray(again.reward), [0, 0])
  # The group quantile equals jnp.quantile for uneven groups and every q.
  values = jnp.asarray([5., 1., 9., 3., 3., 7., 2.])
  groups = jnp.asarray([0, 1, 0, 2, 0, 1, 2])
  for q in (0.0, 0.3, 0.5, 0.9, 1.0):
    expect = [np.quantile(np.asarray(values)[np.asarray(groups) == g], q) for g in groups]
    np.testing.assert_allclose(np.asarray(rewards._group_quantile(values, groups, 3, q)),
                               expect, rtol=1e-6)


def test_tightening_goes_from_loose_to_tight_monotonically():
  schedule = rewards.tightening(loose=3.0, tight=1.0, steps=8, hold=4)
  values = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(20)))
  assert values[0] == 3.0 and np.all(values[:5] == 3.0)  # held loose
  np.testing.assert_allclose(values[8], 2.0)  # halfway down
  assert np.all(values[12:] == 1.0)  # tight from step hold + steps on
  assert np.all(np.diff(values) <= 0) and np.any(np.diff(values) < 0)
  with pytest.raises(ConfigError, match="loose >= tight > 0"):
    rewards.tightening(loose=1.0, tight=2.0)
  with pytest.raises(ConfigError, match="loose >= tight > 0"):
    rewards.tightening(loose=1.0, tight=0.0)


def test_effort_task_names_the_level_and_keeps_the_verifier(tokenizer):
  inner = Arithmetic(num_train=5, num_test=4)
  task = effort.EffortTask(inner)
  assert len(task.train) == 15 and len(task.test) == 12
  record = task.train[7]  # problem 2 at level 1
  assert record["effort"] == "high" and record["effort_level"] == 1 and record["problem"] == 2
  assert record["question"] == inner.train[2]["question"]
  assert task.prompt(record) == "effort:high " + inner.prompt(inner.train[2])
  tokenizer.encode(task.prompt(record))  # the CharTokenizer can write every level
  for i in (0, 1, 2):
    assert task.verify(inner.train[2]["solution"], task.train[6 + i])
    assert task.solution(task.train[6 + i]) == inner.train[2]["solution"]
  assert not task.verify("#0", record)
  assert task.answer("1+2=3;#3") == "3" and task.well_formed("1+2=3;#3")
  custom = effort.EffortTask(inner, levels=("low", "max"), template="[{level}] ")
  assert custom.prompt(custom.train[1]).startswith("[max] ")
  assert effort.level_ids(custom, "test").tolist() == [0, 1] * 4
  assert not hasattr(task, "verify_batch")  # Arithmetic has none: the loop calls verify

  class Judged(Arithmetic):
    def verify_batch(self, completions, records):
      return [self.verify(c, r) for c, r in zip(completions, records)]

  judged = effort.EffortTask(Judged(num_train=5))
  assert judged.verify_batch([inner.train[2]["solution"], "#0"], [judged.train[7]] * 2) == [
      True, False]


def test_the_level_conditioned_warm_start_answers_directly_in_each_levels_share():
  from experiments.effort_demo import LevelShortcut  # the third try's demonstrations
  inner = Arithmetic(digits=2, operands=3, num_train=1000)
  task = LevelShortcut(inner, direct=(0.9, 0.5, 0.0))
  solutions = [task.solution(task.train[i]) for i in range(len(task.train))]
  assert solutions == [task.solution(task.train[i]) for i in range(len(task.train))]  # pure
  for level, share in enumerate((0.9, 0.5, 0.0)):
    records = range(level, len(task.train), 3)
    direct = [solutions[i] == "#" + task.train[i]["answer"] for i in records]
    assert abs(np.mean(direct) - share) < 0.05, (level, np.mean(direct))
    for i, bare in zip(records, direct):  # either answer is right; the rest is the column
      assert task.verify(solutions[i], task.train[i])
      assert bare or solutions[i] == inner.train[i // 3]["solution"]
  # A problem's levels draw apart: it is not direct at every level or at none.
  low, high = (np.array([solutions[i].startswith("#") for i in range(j, 3000, 3)])
               for j in (0, 1))
  assert 0.3 < np.mean(low != high) < 0.7
  with pytest.raises(ConfigError, match=r"a probability per level \('low', 'high', 'max'\)"):
    LevelShortcut(inner, direct=(0.5, 0.5))
  with pytest.raises(ConfigError, match="a probability per level"):
    LevelShortcut(inner, direct=(0.5, 1.5, 0.0))


def test_effort_bindings_that_cannot_work_raise_clearly():
  with pytest.raises(ConfigError, match=r"levels must lie in \[0, 2\)"):
    rewards.effort_budget(levels=[0, 1, 2], multipliers=(0.5, 1.0))
  with pytest.raises(ValueError, match="quantile must be in"):
    rewards.effort_budget(levels=[0], quantile=1.5)
  with pytest.raises(ValueError, match="one budget per record"):
    rewards.effort_budget(levels=[0, 1], budgets=[1.0, 2.0, 3.0])
  t = rewards.effort_budget(levels=[0])
  no_ids = _rollouts([3], [0]).replace(record_ids=None)
  with pytest.raises(ValueError, match="needs Rollouts.record_ids"):
    t.update(no_ids, t.init(), step=0)
  with pytest.raises(ConfigError, match="must contain"):
    effort.EffortTask(Arithmetic(), template="effort ")
  with pytest.raises(ValueError, match="distinct"):
    effort.EffortTask(Arithmetic(), levels=("low", "low"))

  class WithEnvironment(Arithmetic):
    environment = object()

  with pytest.raises(ValueError, match="multi-turn episodes"):
    effort.EffortTask(WithEnvironment())


def test_the_budget_sweep_runs_once_per_effort_level(tokenizer, tmp_path):
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=1, intermediate_size=64)
  task = effort.EffortTask(HasOne())
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  params, _ = sft.warm_start(params, cfg, task, tokenizer, steps=60, batch_size=12,
                             seq_len=24, progress=False)
  engine = JaxEngine(cfg, params)
  spec = eval_lib.SampledEval(samples=4, ks=(1, 4), budgets=(2, 4, 8))
  by_level = effort.sampled_eval_by_level(engine, task, tokenizer, spec, num_problems=4)
  assert list(by_level) == ["low", "high", "max"]  # one curve per level
  for report in by_level.values():
    assert report["prompts"] == 4 and sorted(report["budgets"]) == [2, 4, 8]
    accuracy = [report["budgets"][b]["accuracy"] for b in (2, 4, 8)]
    assert accuracy == sorted(accuracy)
    assert len(report["lengths"]["correct"]) + len(report["lengths"]["incorrect"]) == 16
  path = evaluation.write_level_plot(by_level, str(tmp_path / "plots"), title="tiny")
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # K3's budgets from the model's own lengths: the records asked for, NaN elsewhere.
  budgets = effort.estimate_budgets(engine, task, tokenizer, samples=4, max_new_tokens=8,
                                    records=[0, 1, 2, 5], quantile=1.0)
  assert budgets.shape == (36,) and np.isfinite(budgets[[0, 1, 2, 5]]).all()
  assert np.isnan(np.delete(budgets, [0, 1, 2, 5])).all()
  assert budgets[0] <= 0.5 * 8 and budgets[2] <= 2.0 * 8  # at most max_new x multiplier

  # evaluate_checkpoint (experiments/eval.py) adds the per-level sweep and its plot.
  run_dir = tmp_path / "run"
  state = loop.init_state(params, loop.rl_optimizer(1e-4), helpers.parts(
      cfg, engine=None, task=task, tokenizer=tokenizer, config=RLConfig()), 0)
  checkpointer = Checkpointer(str(run_dir / "checkpoints"))
  checkpointer.save(1, state)
  checkpointer.close()
  model = lambda vocab: config.tiny(vocab, hidden_size=32, num_layers=1, intermediate_size=64)
  report, paths = evaluation.evaluate_checkpoint(str(tmp_path / "eval"), task=task, spec=spec,
                                                 run_dir=str(run_dir), model=model,
                                                 num_records=3)
  assert os.path.basename(paths[-1]) == "accuracy_vs_budget_by_effort.png"
  saved = json.load(open(tmp_path / "eval" / "report.json"))
  assert list(saved["effort"]) == ["low", "high", "max"]
  assert saved["effort"]["max"]["prompts"] == 3 and set(saved["effort"]["low"]["budgets"]) == {
      "2", "4", "8"}


def test_the_loop_gives_the_budget_transform_each_completions_record(tokenizer, tiny_cfg,
                                                                      tiny_params):
  task = effort.EffortTask(Arithmetic(num_train=6, num_test=10))
  rl = RLConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=8, seq_len=32)
  reward = rewards.named_chain({
      "correctness": rewards.correctness(),
      "effort": rewards.effort_budget(levels=effort.level_ids(task), quantile=0.5)})
  steps, _ = helpers.steps(tiny_params, tiny_cfg, engine=JaxEngine(tiny_cfg, tiny_params),
                           task=task, tokenizer=tokenizer, config=rl, reward=reward)
  record = next(steps)
  budget = np.asarray(record.state.reward_state["effort"]["budget"])
  records = [t.record for t in record.trajectories]
  drawn = sorted({r["problem"] * 3 + r["effort_level"] for r in records})
  assert np.flatnonzero(np.isfinite(budget)).tolist() == drawn
  lengths = np.array([t.policy_count for t in record.trajectories]).reshape(2, 4)
  for g in range(2):  # each drawn record's budget is its group's median x its multiplier
    r = records[4 * g]
    expect = np.quantile(lengths[g], 0.5) * (0.5, 1.0, 2.0)[r["effort_level"]]
    np.testing.assert_allclose(budget[r["problem"] * 3 + r["effort_level"]], expect)


def test_the_k3_recipe_runs_through_a_server_process(tokenizer, tiny_cfg, tiny_params,
                                                     tmp_path):
  """Effort prompts and budgets, lambda-partial rollouts and the trust region, together: the
  partial path gives the transform each trajectory's record too."""
  from rollouts.sglang_engine import local_engine

  task = effort.EffortTask(Arithmetic(num_train=8, num_test=10))
  rl = RLConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=12, seq_len=40,
                learning_rate=1e-3)
  reward = rewards.named_chain({
      "correctness": rewards.correctness(),
      "effort": rewards.effort_budget(levels=effort.level_ids(task),
                                      schedule=rewards.tightening(steps=2))})
  engine = local_engine(tiny_cfg, tiny_params, 0, weights_dir=str(tmp_path))
  try:
    partial = sources.Partial(finish_fraction=0.5)
    sources.check(partial, sources.Context(engine, task, tokenizer, rl, None))
    steps, _ = helpers.steps(tiny_params, tiny_cfg, engine=engine, task=task,
                             tokenizer=tokenizer, config=rl, reward=reward, rollouts=partial,
                             correction=corrections.trust_region(low=-0.5, high=0.5))
    records = [next(steps) for _ in range(3)]
  finally:
    engine.close()
  trained = {t.record["problem"] * 3 + t.record["effort_level"] for step in records
             for t in step.trajectories}
  budget = np.asarray(records[-1].state.reward_state["effort"]["budget"])
  assert set(np.flatnonzero(np.isfinite(budget)).tolist()) == trained
  for step in records:
    assert 0.0 <= step.metrics["trust_region_masked"] <= 1.0
    assert step.metrics["partial_iterations"] >= 1 and step.metrics["groups_trained"] >= 1
