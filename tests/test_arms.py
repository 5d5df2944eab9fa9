"""Arms (rl/arms.py): K LoRA experiments over one frozen base. An arm trained among K, in one
vmapped step, ends with the params it has when trained alone by the ordinary train step (its
own seed, learning rate and batches; float32), and an arm run among K by arms_steps makes
the rollouts and ends with the adapters of the same arm run alone by rl_steps; a batch whose
rows belong to different arms decodes each row with its own arm's adapters. Arms resume
exactly from a checkpoint of their joint state, and export each arm's adapters for peft.
Through a server, each arm's adapters go under a name of its own, which its requests name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import hf_lora, lora, transformer
from models.lora import LoraConfig
from rl import arms, loop, losses
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.loop import rl_optimizer
from rl.packing import trajectory_batch
from rl.train_step import init_train_state, make_train_step, policy_logprobs
from rollouts import decoding
from rollouts.jax_engine import JaxEngine
from tests import helpers
from tests.test_lora import _moved
from tests.test_rl import PickADigit, digit_model  # noqa: F401 - the fixture

RATES = (1e-3, 3e-3, 1e-2)


def _batch(seed: int, trajectories: int):
  """A minibatch of `trajectories` random trajectories (rows vary with the seed)."""
  rng = np.random.default_rng(seed)
  prompts = [[1] + rng.integers(3, 40, rng.integers(2, 6)).tolist() for _ in range(trajectories)]
  completions = [rng.integers(3, 40, rng.integers(3, 12)).tolist() for _ in range(trajectories)]
  logp = [rng.normal(-3.5, 0.3, len(c)).astype(np.float32) for c in completions]
  batch, _ = trajectory_batch(prompts, completions, logp, rng.normal(size=trajectories).tolist(),
                              [True] * trajectories, seq_len=16, row_multiple=2)
  return batch


def _adapters(cfg, params, seed: int):
  return lora.init_adapters(params, LoraConfig(rank=4, alpha=8.0), cfg,
                            jax.random.PRNGKey(seed))


def test_an_arm_trained_among_k_has_the_params_it_has_trained_alone(tiny_cfg, tiny_params):
  """Three arms (seeds, learning rates and batches of their own; batches of different row
  counts, padded together) over one base, three updates in one vmapped step each, against
  each arm's three updates by the ordinary LoRA train step with rl_optimizer at its rate."""
  loss_fn = losses.bind("dapo", {})
  adapters = [_adapters(tiny_cfg, tiny_params, 10 + k) for k in range(len(RATES))]
  batches = [[_batch(100 * k + i, 3 + 2 * k + i) for i in range(3)] for k in range(len(RATES))]
  assert len({b[0].tokens.shape[0] for b in batches}) > 1  # the padding is exercised
  optimizer = arms.arms_optimizer()
  together = make_train_step(tiny_cfg, optimizer, loss_fn, arms=True)
  state = arms.init_arms(adapters, RATES, optimizer)
  np.testing.assert_allclose(arms.learning_rates(state), RATES, rtol=1e-7)
  losses_together = []
  for i in range(3):
    state, metrics = together(state, arms.stack_batches([b[i] for b in batches]), None,
                              tiny_params)
    assert metrics["loss"].shape == (len(RATES),)
    losses_together.append(np.asarray(metrics["loss"]))
  for k, rate in enumerate(RATES):
    alone_optimizer = rl_optimizer(rate)
    alone = make_train_step(tiny_cfg, alone_optimizer, loss_fn)
    arm = init_train_state(adapters[k], alone_optimizer)
    for i in range(3):
      arm, metrics = alone(arm, jax.tree.map(jnp.asarray, batches[k][i]), None, tiny_params)
      np.testing.assert_allclose(losses_together[i][k], metrics["loss"], rtol=1e-5)
    # Adam divides each gradient by its own running scale, so float32 rounding in a small
    # gradient (the vmapped products sum in another order) moves its update by up to the rate
    # times that relative error: 1e-5 is a thousandth of the largest rate's update.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                 arms.unstack(state.params, k), arm.params)
    # The updates are large beside that tolerance: the arms went apart from their start.
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(arm.params), jax.tree.leaves(adapters[k])))
    assert moved > 1e-3
  assert int(arms.unstack(state.step, 0)) == 3


def test_bad_arms_name_what_is_wrong(tiny_cfg, tiny_params):
  with pytest.raises(ValueError, match="2 adapters and 3 learning rates"):
    arms.init_arms([_adapters(tiny_cfg, tiny_params, k) for k in range(2)], RATES,
                   arms.arms_optimizer())


@pytest.mark.parametrize("remat", ["none", "full"])
def test_each_row_of_a_batch_decodes_with_its_own_arms_adapters(tiny_cfg, tiny_params, remat):
  """Rows of arms 2, 0, 1, 2 in one batch: their logits (both layer paths) are each the
  arm's alone, and greedy decoding gives each row the tokens its arm alone gives it."""
  cfg = dataclasses.replace(tiny_cfg, remat=remat)
  trained = [_moved(_adapters(cfg, tiny_params, 20 + k), key=30 + k, size=0.3)
             for k in range(3)]
  row_arms = np.array([2, 0, 1, 2], np.int32)
  rows, seq = len(row_arms), 9
  tokens = jax.random.randint(jax.random.PRNGKey(4), (rows, seq), 3, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
  segments = jnp.ones((rows, seq), jnp.int32)
  logits = lambda params: transformer.forward(params, cfg, tokens, positions, segments) @ (
      transformer.output_projection(tiny_params, cfg))
  together = logits(lora.attach(tiny_params, arms.stack(trained), jnp.asarray(row_arms)))
  alone = [logits(lora.attach(tiny_params, trained[k])) for k in range(3)]
  for row, k in enumerate(row_arms):
    np.testing.assert_allclose(together[row], alone[k][row], atol=2e-5)
    other = alone[(k + 1) % 3][row]  # the arms differ: a mix-up would show
    assert float(jnp.max(jnp.abs(alone[k][row] - other))) > 1e-2

  prompt_lens = jnp.array([4, 7, 9, 5], jnp.int32)
  prompts = jnp.where(jnp.arange(seq)[None, :] >= seq - prompt_lens[:, None], tokens, 0)
  decode = lambda params: decoding.sample(params, prompts, prompt_lens, jax.random.PRNGKey(0),
                                          0.0, 1.0, cfg=cfg, max_new=6, stop_ids=())
  tokens_together, logp_together, *_ = decode(
      lora.attach(tiny_params, arms.stack(trained), jnp.asarray(row_arms)))
  for row, k in enumerate(row_arms):
    tokens_alone, logp_alone, *_ = decode(lora.attach(tiny_params, trained[k]))
    np.testing.assert_array_equal(tokens_together[row], tokens_alone[row])
    np.testing.assert_allclose(logp_together[row], logp_alone[row], atol=2e-5)


def _lora_parts(cfg, base, tokenizer, config, optimizer, *, arms_step: bool):
  """A LoRA run's loop parts over `base` (DAPO on PickADigit, on an embedded engine of its
  own holding the base), its train step over K stacked arms when `arms_step`."""
  step = make_train_step(cfg, optimizer, losses.bind("dapo", {}),
                         micro_batches=config.micro_batches, arms=arms_step)
  return helpers.parts(
      cfg, engine=JaxEngine(cfg, base), task=PickADigit(10), tokenizer=tokenizer, config=config,
      loss="dapo", optimizer=optimizer, base=base,
      train_step=lambda _: lambda train, batch, ref: step(train, batch, ref, base),
      trainer_logprobs=jax.jit(lambda p, b: policy_logprobs(lora.attach(base, p), cfg, b)[0]))


@pytest.mark.slow
def test_arms_in_one_run_make_each_arms_rollouts_and_updates_alone(tokenizer, digit_model):
  """Three arms (seeds, adapters and learning rates of their own) run three RL steps of two
  minibatches together; each arm alone, by rl_steps on an engine of its own, makes the same
  trajectories and rewards at every step and ends with the same adapters."""
  cfg, base = digit_model
  config = RLConfig(prompts_per_step=4, samples_per_prompt=8, max_new_tokens=4, seq_len=16,
                    minibatches=2)
  rates, seeds = (1e-2, 3e-2, 1e-1), (0, 1, 2)
  adapters = [_adapters(cfg, base, 10 + k) for k in range(3)]
  optimizer = arms.arms_optimizer()
  parts = _lora_parts(cfg, base, tokenizer, config, optimizer, arms_step=True)
  together = arms.arms_steps(arms.init_arms_state(adapters, rates, seeds, optimizer, parts),
                             parts)
  steps_together = [next(together) for _ in range(3)]
  together.close()
  assert len(steps_together[0]) == 3 and steps_together[-1][0].step == 3
  for k in range(3):
    alone_optimizer = rl_optimizer(rates[k])
    alone_parts = _lora_parts(cfg, base, tokenizer, config, alone_optimizer, arms_step=False)
    alone = loop.rl_steps(loop.init_state(adapters[k], alone_optimizer, alone_parts, seeds[k]),
                          alone_parts)
    for records in steps_together:
      mine, record = records[k], next(alone)
      assert [t.token_ids for t in mine.trajectories] == [
          t.token_ids for t in record.trajectories]
      np.testing.assert_array_equal(mine.rewards, record.rewards)
      np.testing.assert_allclose(mine.metrics["loss"], record.metrics["loss"], rtol=1e-4)
    # A hundredth of one Adam update (about the rate): over six updates the rounding that
    # Adam amplifies in small gradients (see the test of the step above) compounds; a wrong
    # rate or another arm's batches would move the adapters by whole updates.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-2 * rates[k]),
                 arms.unstack(mine.state.train.params, k), record.state.train.params)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(record.state.train.params), jax.tree.leaves(adapters[k])))
    assert moved > 1e-3  # the arm learned: its rollouts after the first came from its update
    alone.close()
  # The arms went their own ways: their rollouts differ.
  tokens = lambda k: [t.token_ids for r in steps_together for t in r[k].trajectories]
  assert tokens(0) != tokens(1) != tokens(2)


@pytest.mark.slow
def test_arms_resume_exactly_from_a_checkpoint_and_export_each_arm(tokenizer, digit_model,
                                                                   tmp_path):
  """Two arms' joint state saved after their first step and restored into a fresh state's
  shape: the restored run's next step is the uninterrupted run's, bit for bit; each arm's
  PEFT export loads back as that arm's adapters."""
  cfg, base = digit_model
  config = RLConfig(prompts_per_step=4, samples_per_prompt=8, max_new_tokens=4, seq_len=16)
  optimizer = arms.arms_optimizer()
  parts = _lora_parts(cfg, base, tokenizer, config, optimizer, arms_step=True)
  adapters = [_adapters(cfg, base, 10 + k) for k in range(2)]
  fresh = lambda: arms.init_arms_state(adapters, (3e-2, 1e-1), (0, 1), optimizer, parts)
  steps = arms.arms_steps(fresh(), parts)
  first = next(steps)
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  checkpointer.save(1, first[0].state)
  checkpointer.close()
  second = next(steps)
  steps.close()
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  resumed = arms.arms_steps(checkpointer.restore(fresh()), parts)
  again = next(resumed)
  resumed.close()
  checkpointer.close()
  for k in range(2):
    assert [t.token_ids for t in again[k].trajectories] == [
        t.token_ids for t in second[k].trajectories]
  jax.tree.map(np.testing.assert_array_equal, again[0].state.train, second[0].state.train)
  np.testing.assert_allclose(arms.learning_rates(again[0].state.train), (3e-2, 1e-1))

  trained = second[0].state.train
  for k, path in enumerate(arms.export_adapters(trained, cfg, LoraConfig(rank=4, alpha=8.0),
                                                str(tmp_path / "export"))):
    assert path.endswith(f"arm_{k}")
    loaded, _ = hf_lora.load_adapter(path, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 loaded, arms.unstack(trained.params, k))


@pytest.mark.slow
def test_arms_through_a_server_name_each_arms_own_adapters(tokenizer, digit_model, tmp_path):
  """Two arms, three steps, through our server with --enable-lora (SGLang's LoRA API): every
  request of arm k at step s names run-arm<k>-v<s>, the tokens it gets are tagged with s,
  and its log-probs are arm k's policy's (the trainer's, within float32 rounding: after the
  first update the arms' policies differ)."""
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  from tests.test_server_lora import LORA
  cfg, base = digit_model
  lora_cfg = LoraConfig(rank=4, alpha=8.0)
  config = RLConfig(prompts_per_step=4, samples_per_prompt=8, max_new_tokens=4, seq_len=16,
                    lora=lora_cfg)
  optimizer = arms.arms_optimizer()
  with helpers.serving(cfg, base, lora=LORA) as (url, scheduler):
    named = []
    submit = scheduler.submit
    scheduler.submit = lambda requests: named.extend(
        None if r.adapter is None else r.adapter.name for r in requests) or submit(requests)
    engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir=str(tmp_path / "w"),
                          rid_prefix="run", export_dtype="float32")
    try:
      parts = _lora_parts(cfg, base, tokenizer, config, optimizer, arms_step=True)
      parts = dataclasses.replace(parts, context=dataclasses.replace(parts.context,
                                                                     engine=engine))
      adapters = [_adapters(cfg, base, 10 + k) for k in range(2)]
      steps = arms.arms_steps(arms.init_arms_state(adapters, (3e-2, 1e-1), (0, 1), optimizer,
                                                   parts), parts)
      records = [next(steps) for _ in range(3)]
      steps.close()
    finally:
      engine.close()
  requests = config.prompts_per_step * config.samples_per_prompt
  assert named == [f"run-arm{k}-v{s}" for s in range(3) for k in range(2)
                   for _ in range(requests)]
  for s, step in enumerate(records):
    for record in step:
      assert all(set(t.versions) == {s} for t in record.trajectories)
      assert record.metrics["engine_logp_diff_max"] < 1e-3
  tokens = lambda k: [t.token_ids for t in records[-1][k].trajectories]
  assert tokens(0) != tokens(1)


def test_arms_refuse_what_they_cannot_run_with(tokenizer, tiny_cfg, tiny_params):
  config = RLConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, seq_len=16,
                    weight_sync_every=2)
  parts = _lora_parts(tiny_cfg, tiny_params, tokenizer, config, arms.arms_optimizer(),
                      arms_step=True)
  with pytest.raises(ValueError, match="arms sync every step"):
    next(arms.arms_steps(arms.init_arms_state([_adapters(tiny_cfg, tiny_params, 0)], [1e-3], [0],
                                              arms.arms_optimizer(), parts), parts))
  without_base = dataclasses.replace(parts, base=None)
  with pytest.raises(ValueError, match="give Parts.base"):
    next(arms.arms_steps(loop.init_state(tiny_params, arms.arms_optimizer(), without_base, 0),
                         without_base))
