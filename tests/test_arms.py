"""Arms (rl/arms.py): K LoRA experiments over one frozen base. An arm trained among K, in one
vmapped step, ends with the params it has when trained alone by the ordinary train step (its
own seed, learning rate and batches; float32); a batch whose rows belong to different arms
decodes each row with its own arm's adapters."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import lora, transformer
from models.lora import LoraConfig
from rl import arms, losses
from rl.loop import rl_optimizer
from rl.packing import trajectory_batch
from rl.train_step import init_train_state, make_train_step
from rollouts import decoding

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


def _moved(adapters, seed: int):
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_each_row_of_a_batch_decodes_with_its_own_arms_adapters(tiny_cfg, tiny_params, remat):
  """Rows of arms 2, 0, 1, 2 in one batch: their logits (both layer paths) are each the
  arm's alone, and greedy decoding gives each row the tokens its arm alone gives it."""
  cfg = dataclasses.replace(tiny_cfg, remat=remat)
  trained = [_moved(_adapters(cfg, tiny_params, 20 + k), 30 + k) for k in range(3)]
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
