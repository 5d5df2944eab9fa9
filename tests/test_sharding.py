"""Parameter and optimizer-state sharding on an 8-device host mesh: the train step gives one
device's loss and gradients, and large weights really are split."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from models import config, sharding, transformer
from rl import losses
from rl.train_step import init_train_state, make_train_step
from tests.test_attention import _packed_batch, assert_same_gradients, gradient_recorder

CFG = config.ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128, tie_embeddings=False)


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CFG, jax.random.PRNGKey(0))


def test_every_parameter_has_logical_axes_and_a_valid_spec(params):
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  shardings = sharding.param_shardings(params, mesh)
  specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
  assert specs["['layers_0']['self_attn']['q_proj']['kernel']"] == jax.sharding.PartitionSpec(
      "fsdp", "tensor", None)
  assert specs["['layers_0']['mlp']['down_proj']['kernel']"] == jax.sharding.PartitionSpec(
      "tensor", "fsdp")
  assert specs["['embed_tokens']['embedding']"] == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert specs["['norm']['scale']"] == jax.sharding.PartitionSpec(None)
  sharding.check_sharded(params, mesh, min_elements=1024)


def test_check_sharded_names_weights_left_whole(params):
  mesh = sharding.make_mesh(fsdp=8)
  odd = config.ModelConfig(vocab_size=95, hidden_size=60, num_layers=1, num_heads=3,
                           num_kv_heads=3, head_dim=20, intermediate_size=90)
  odd_params = transformer.init_params(odd, jax.random.PRNGKey(0))
  with pytest.raises(sharding.MeshUnavailable, match="embed_tokens"):
    sharding.check_sharded(odd_params, mesh, min_elements=1024)


@pytest.mark.parametrize("axes,remat", [(dict(fsdp=4, tensor=2), "none"),
                                        (dict(data=2, fsdp=4), "none"),
                                        (dict(fsdp=4, tensor=2), "full")],
                         ids=["fsdp=4 x tensor=2", "data=2 x fsdp=4",
                              "fsdp=4 x tensor=2, layers rematerialised (a scan)"])
def test_sharded_train_step_equals_one_device(params, axes, remat):
  cfg = dataclasses.replace(CFG, remat=remat)
  batch = _packed_batch(rows=8, seq=40, vocab=cfg.vocab_size, seed=3)
  loss_fn = losses.bind("grpo", {"kl_coef": 0.0})
  recorder = gradient_recorder()
  state = init_train_state(params, recorder)
  one, one_metrics = make_train_step(CFG, recorder, loss_fn)(state, batch)  # no remat

  mesh = sharding.make_mesh(**axes)
  shardings = sharding.state_shardings(state, recorder, mesh)
  placed = jax.device_put(state, shardings)
  step = sharding.on_mesh(mesh, make_train_step(cfg, recorder, loss_fn, state_shardings=shardings))
  sharded, metrics = step(placed, batch)
  for key in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(metrics[key], one_metrics[key], rtol=1e-5, err_msg=key)
  assert_same_gradients(sharded.opt_state, one.opt_state)
  kernel = sharded.params["layers_0"]["mlp"]["gate_proj"]["kernel"]
  assert kernel.sharding.is_equivalent_to(
      shardings.params["layers_0"]["mlp"]["gate_proj"]["kernel"], kernel.ndim)
  assert kernel.addressable_shards[0].data.size < kernel.size  # really split


def test_adamw_moments_are_sharded_like_their_params(params):
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  adamw = optax.adamw(1e-3)
  state = init_train_state(params, adamw)
  shardings = sharding.state_shardings(state, adamw, mesh)
  placed = jax.device_put(state, shardings)
  mu = placed.opt_state[0].mu["layers_1"]["self_attn"]["o_proj"]["kernel"]
  assert mu.sharding.spec == jax.sharding.PartitionSpec("tensor", None, "fsdp")
  assert placed.opt_state[0].count.sharding.spec == jax.sharding.PartitionSpec()


def test_place_rows_puts_each_devices_rows_on_it():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  tokens = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
  placed = sharding.place_rows({"tokens": tokens, "odd": tokens[:6]}, mesh)
  np.testing.assert_array_equal(np.asarray(placed["tokens"]), tokens)
  # Rows over data x fsdp (4 parts of 2 rows), the same rows on both tensor devices.
  for shard in placed["tokens"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), tokens[shard.index])
    assert shard.data.shape == (2, 3)
  # 6 rows do not split 4 ways: only the data axis (2) splits them.
  assert {s.data.shape for s in placed["odd"].addressable_shards} == {(3, 3)}
