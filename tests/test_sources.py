"""Rollout sources in combination, on a server that can abort: what the loop used to ignore
silently (partial rollouts took no KL in the reward and no dynamic sampling) now works, since
rewards and the KL run once after any source; and a server run evaluates on its servers."""

import jax
import jax.numpy as jnp
import numpy as np

from models import config, transformer
from rl import eval as eval_lib
from rl import sources, trainer
from rl.config import KLReward, RLConfig
from rl.packing import trajectory_batch
from rl.tasks.arithmetic import Arithmetic
from rl.train_step import policy_logprobs
from rollouts.jax_engine import JaxEngine
from rollouts.sglang_engine import local_engine
from tests import helpers
from tests.test_rl import PickADigit, digit_model  # noqa: F401 - the fixture

# 4 requests in flight, 16 asked for: once the first completions hold the budget, the
# requests not yet sent wait for the next iteration.
PARTIAL = dict(token_budget=6)
SIZES = RLConfig(prompts_per_step=2, samples_per_prompt=8, max_new_tokens=4, seq_len=16)


def test_partial_rollouts_take_the_kl_in_the_reward(tokenizer, digit_model, tmp_path):
  """Each trained trajectory's reward is its correctness minus coef x its sequence k1 to the
  reference, by hand, for trajectories resumed across steps too."""
  cfg, params = digit_model
  other = transformer.init_params(cfg, jax.random.PRNGKey(5))  # a reference far from params
  reference_logprobs = jax.jit(lambda b: policy_logprobs(other, cfg, b)[0])
  engine = local_engine(cfg, params, 0, weights_dir=str(tmp_path), max_batch=4)
  try:
    steps, _ = helpers.steps(
        params, cfg, engine=engine, task=PickADigit(10), tokenizer=tokenizer, loss="rloo",
        config=SIZES, rollouts=sources.Partial(**PARTIAL), kl_reward=KLReward(coef=0.1),
        reference_logprobs=reference_logprobs)
    records = [next(steps) for _ in range(3)]
  finally:
    engine.close()
  assert sum(r.metrics["partial_aborted"] for r in records) > 0
  for record in records:
    for t, reward in zip(record.trajectories, record.rewards):
      batch = jax.tree.map(jnp.asarray, trajectory_batch(
          [t.prompt_ids], [t.token_ids], [t.logprobs], [0.0], [True], 16)[0])
      n = len(t.prompt_ids) + len(t.token_ids) - 1
      ref = np.asarray(reference_logprobs(batch))[0][:n]
      kl = float(np.sum((np.asarray(batch.old_logp)[0][:n] - ref)
                        * np.asarray(batch.loss_mask)[0][:n]))
      np.testing.assert_allclose(reward, float(t.correct) - 0.1 * kl, rtol=1e-4, atol=1e-5)


def test_dynamic_sampling_over_partial_rollouts_trains_only_mixed_groups(
    tokenizer, digit_model, tmp_path):
  """DynamicSampling(Partial(...)): the complete groups whose verdicts are all equal are
  dropped and partial iterations go on until the step is full."""
  cfg, params = digit_model
  engine = local_engine(cfg, params, 0, weights_dir=str(tmp_path), max_batch=4)
  try:
    steps, _ = helpers.steps(
        params, cfg, engine=engine, task=PickADigit(10), tokenizer=tokenizer, loss="dapo",
        config=SIZES,
        # Room for the partial trajectories of up to 30 rounds: the server samples without
        # seeds (as SGLang does without --enable-deterministic-inference), so how many wait
        # varies from run to run (up to 72 seen).
        rollouts=sources.DynamicSampling(sources.Partial(**PARTIAL, replay_capacity=256),
                                         max_rounds=30))
    records = [next(steps) for _ in range(3)]
  finally:
    engine.close()
  for record in records:
    assert record.metrics["groups_trained"] == 2 and len(record.trajectories) == 16
    for g in range(2):  # every group trained has right and wrong samples
      assert len({t.correct for t in record.trajectories[8 * g:8 * g + 8]}) == 2
  assert sum(r.metrics["generation_rounds"] for r in records) > 3  # uniform ones were dropped
  assert sum(r.metrics["partial_aborted"] for r in records) > 0


def test_a_server_run_evaluates_on_its_servers(tokenizer, tmp_path):
  """With servers holding the current weights, the held-out evaluation runs there: the same
  greedy accuracy and lengths as the embedded engine's on the same params."""
  model = lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64)
  run = trainer.build(
      str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=64, num_test=16), model=model,
      rl=RLConfig(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=16, seq_len=32),
      start=trainer.WarmStart(steps=20, batch_size=16),
      engine=lambda cfg, params, version: local_engine(cfg, params, version,
                                                        weights_dir=str(tmp_path / "weights")),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), progress=False))
  try:
    assert run.evaluation_engine is run.parts.context.engine
    assert run.evaluation_engine.capabilities.serves_all_processes  # the servers
    served = run.evaluate(0)
    embedded = eval_lib.greedy_eval(JaxEngine(run.cfg, run.state.train.params), run.task,
                                    run.tokenizer, num_records=16, max_new_tokens=16)
    assert served == embedded
  finally:
    run.close()
