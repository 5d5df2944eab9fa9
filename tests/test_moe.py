"""Mixtures of experts (models/transformer.py MoE, the qwen3_moe and deepseek_v3 families):
dropless expert computation against a token-by-token reference, Qwen3-MoE's and DeepSeek-V3's
logits against transformers in float32 on padded and packed rows, the engine and the trainer
computing the same log-probs, the routes a forward pass returns and routing replay, routing
metrics, and the configurations that cannot run refused. tests/test_hf.py runs both families
through every Hugging Face check the dense families pass (greedy generation, exports, bf16)."""

import base64
import dataclasses
import functools
import json
import os
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch  # the test extra pins the CPU wheel
import transformers
from safetensors.numpy import load_file, save_file

from models import hf, layers, mixture, sharding, transformer
from models.config import MlaConfig, ModelConfig, MoeConfig, tiny
from rl import batch as batch_lib
from rl import losses
from rl.config import RLConfig
from rl.packing import trajectory_batch
from rl.tasks.arithmetic import Arithmetic
from rl.train_step import init_train_state, make_train_step, policy_logprobs, replayed_routes
from rl.trajectory import Trajectory
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from rollouts.sglang import SGLangClient
from rollouts.sglang_engine import SGLangEngine
from tests import helpers
from tests.test_attention import _packed_batch, assert_same_gradients, gradient_recorder

VOCAB = 96


def _reference_experts(x, experts, weights, gate, up, down):
  """Token by token, expert by expert: sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
  out = []
  for t in range(x.shape[0]):
    total = 0.0
    for e, w in zip(experts[t], weights[t]):
      total = total + w * (jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e]
    out.append(total)
  return jnp.stack(out)


def test_dropless_experts_equal_each_token_through_its_experts_and_differentiate_alike():
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  tokens, hidden, size, num_experts, k = 13, 8, 6, 5, 2
  x = jax.random.normal(keys[0], (tokens, hidden))
  # Expert 4 gets no token; expert 0 most of them.
  experts = jnp.array([[0, 1], [0, 2], [3, 0], [1, 0], [0, 3], [2, 1], [0, 1], [1, 2], [3, 2],
                       [0, 2], [2, 0], [1, 3], [0, 1]], jnp.int32)
  weights = jax.nn.softmax(jax.random.normal(keys[1], (tokens, k)))
  gate, up = (jax.random.normal(key, (num_experts, hidden, size)) for key in keys[2:4])
  down = jax.random.normal(keys[4], (num_experts, size, hidden))
  args = (x, experts, weights, gate, up, down)
  np.testing.assert_allclose(mixture.dropless_experts(*args), _reference_experts(*args),
                             rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda x, w, g, u, d: jnp.sum(f(x, experts, w, g, u, d) ** 2)
  wrt = (0, 1, 2, 3, 4)
  got = jax.grad(loss(mixture.dropless_experts), wrt)(x, weights, gate, up, down)
  want = jax.grad(loss(_reference_experts), wrt)(x, weights, gate, up, down)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(got[2][4]) == 0)  # an expert no token chose gets no gradient


def test_capacity_experts_equal_dropless_with_room_and_drop_the_overflow_in_token_order():
  keys = jax.random.split(jax.random.PRNGKey(1), 5)
  tokens, hidden, size, num_experts = 13, 8, 6, 5
  x = jax.random.normal(keys[0], (tokens, hidden))
  experts = jnp.array([[0, 1], [0, 2], [3, 0], [1, 0], [0, 3], [2, 1], [0, 1], [1, 2], [3, 2],
                       [0, 2], [2, 0], [1, 3], [0, 1]], jnp.int32)  # expert 0 gets 9 pairs
  weights = jax.nn.softmax(jax.random.normal(keys[1], (tokens, 2)))
  gate, up = (jax.random.normal(key, (num_experts, hidden, size)) for key in keys[2:4])
  down = jax.random.normal(keys[4], (num_experts, size, hidden))
  args = (x, experts, weights, gate, up, down)
  np.testing.assert_allclose(mixture.capacity_experts(*args, capacity=9),
                             mixture.dropless_experts(*args), rtol=1e-5, atol=1e-5)
  # Room for 4 an expert: each expert's pairs past its 4th, in token order, drop (as if
  # their weight were 0): 5 of expert 0's 9, 3 of expert 1's 7, 2 of expert 2's 6.
  kept, taken = np.ones((tokens, 2), np.float32), np.zeros(num_experts, int)
  for t, slot in np.ndindex(tokens, 2):
    e = int(experts[t, slot])
    kept[t, slot] = taken[e] < 4
    taken[e] += 1
  assert kept.size - kept.sum() == 10
  want = _reference_experts(x, experts, weights * kept, gate, up, down)
  np.testing.assert_allclose(mixture.capacity_experts(*args, capacity=4), want, rtol=1e-5,
                             atol=1e-5)
  loss = lambda f: lambda x, g: jnp.sum(f(x, experts, weights, g, up, down) ** 2)
  got = jax.grad(loss(functools.partial(mixture.capacity_experts, capacity=9)),
                 (0, 1))(x, gate)
  expected = jax.grad(loss(mixture.dropless_experts), (0, 1))(x, gate)
  for g, w in zip(got, expected):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A Qwen3-MoE of 3 layers, layer 1 sparse (decoder_sparse_step 2), 8 experts with 2 a
  token and renormalised weights (Qwen3-30B-A3B's norm_topk_prob)."""
  config = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
      decoder_sparse_step=2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
      pad_token_id=None)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  path = str(tmp_path_factory.mktemp("qwen3_moe"))
  model.save_pretrained(path)
  return path, model


def _logits(params, cfg, tokens, positions, segments):
  hidden = transformer.forward(params, cfg, jnp.asarray(tokens), jnp.asarray(positions),
                               jnp.asarray(segments))
  return np.asarray(hidden @ transformer.output_projection(params, cfg))


def test_qwen3_moe_logits_equal_transformers_within_1e_5(checkpoint):
  path, model = checkpoint
  cfg, params = hf.load(path)
  assert cfg.moe == MoeConfig(num_experts=8, experts_per_token=2, expert_size=32,
                              normalize_weights=True, sparse_step=2)
  assert [cfg.sparse(i) for i in range(3)] == [False, True, False]
  _logits_equal_transformers(params, cfg, model)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  """A DeepSeek-V3 of 3 layers (the first dense) with multi-head latent attention (a query
  bottleneck, values narrower than keys, interleaved rope dims, YaRN with DeepSeek's
  mscale_all_dim) and its router: 8 experts in 4 groups, the best 2 eligible, a random
  correction bias, renormalised weights times 2.5, a shared expert; and the same model's
  multi-token-prediction layer, which import skips as transformers does."""
  config = transformers.DeepseekV3Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
      num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
      moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
      max_position_embeddings=64, rope_parameters={
          "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
          "mscale_all_dim": 0.8, "original_max_position_embeddings": 16},
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # norms random too, and the biases, which choose experts
    for p in model.parameters():
      p.normal_(0.0, 0.15)
    for layer in model.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
  path = str(tmp_path_factory.mktemp("deepseek_v3"))
  model.save_pretrained(path)
  tensors = load_file(os.path.join(path, hf.SINGLE))
  tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
  save_file(tensors, os.path.join(path, hf.SINGLE), metadata={"format": "pt"})
  return path, model


def test_deepseek_v3_logits_equal_transformers_within_1e_5(deepseek):
  path, model = deepseek
  cfg, params = hf.load(path)
  assert cfg.mla == MlaConfig(kv_rank=16, rope_dim=8, value_dim=12, q_rank=24)
  assert cfg.head_dim == 24 and cfg.sparse_layers == (1, 2)
  assert cfg.moe == MoeConfig(num_experts=8, experts_per_token=2, expert_size=32,
                              normalize_weights=True, dense_layers=(0,), scoring="sigmoid",
                              correction_bias=True, groups=4, top_groups=2, scaling=2.5,
                              shared_size=32)
  _logits_equal_transformers(params, cfg, model)
  # The trainer can place every parameter (the latent projections have logical axes).
  axes = sharding.param_logical_axes(params)["layers_1"]["self_attn"]
  assert axes["kv_b_proj"]["kernel"] == (None, sharding.HEADS, sharding.HEAD_DIM)


def test_a_deepseek_fp8_export_quantizes_the_latent_projections_and_loads_back(deepseek,
                                                                             tmp_path):
  """FP8 as DeepSeek-V3's checkpoints store it: every projection of attention (the latent
  ones and kv_a_proj_with_mqa included) and of the dense and shared MLPs in blocks, the router
  and the routed experts kept; held packed (a server's weights) it computes what the
  dequantized import does."""
  cfg, params = hf.load(deepseek[0])
  out = hf.save(params, cfg, str(tmp_path / "fp8"), quantization="fp8")
  with open(os.path.join(out, hf.SINGLE), "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  quantized = sorted(n.removesuffix(".weight_scale_inv") for n in header
                     if n.endswith(".weight_scale_inv") and n.startswith("model.layers.1."))
  assert quantized == [f"model.layers.1.{name}" for name in (
      "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
      "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
      "self_attn.q_a_proj", "self_attn.q_b_proj")]
  _, loaded = hf.load(out)
  _, held = hf.load(out, packed=True)
  tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 12))
  positions, segments = np.arange(12)[None].repeat(2, 0), np.ones((2, 12), np.int32)
  np.testing.assert_array_equal(_logits(held, cfg, tokens, positions, segments),
                                _logits(loaded, cfg, tokens, positions, segments))


def _logits_equal_transformers(params, cfg, model):
  """Our logits are `model`'s within 1e-5 on padded rows and on a packed row."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, VOCAB, (3, 20))
  lengths = [20, 13, 6]
  mask = np.array([[1] * n + [0] * (20 - n) for n in lengths])
  with torch.no_grad():
    want = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
  got = _logits(params, cfg, tokens * mask, np.arange(20)[None].repeat(3, 0), mask)
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5, rtol=0)
  # Three documents packed in one row (and a padding token): each as if alone.
  docs = [rng.integers(0, VOCAB, n) for n in (9, 5, 12)]
  packed = np.concatenate(docs + [np.zeros(1, np.int64)])[None]
  segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [[0]])[None]
  positions = np.concatenate([np.arange(len(d)) for d in docs] + [[0]])[None]
  got = _logits(params, cfg, packed, positions, segments)
  start = 0
  for doc in docs:
    with torch.no_grad():
      want = model(torch.tensor(doc[None])).logits.numpy()[0]
    np.testing.assert_allclose(got[0, start:start + len(doc)], want, atol=1e-5, rtol=0)
    start += len(doc)


def test_the_engine_and_the_trainer_compute_the_same_log_probs_on_a_mixture(checkpoint):
  cfg, params = hf.load(checkpoint[0])
  prompts = [[5, 17, 33, 2], [40, 41], [7] * 9]
  made = JaxEngine(cfg, params).generate(prompts, SamplingParams(16, temperature=1.0), seed=0)
  batch, _ = trajectory_batch(prompts, [c.token_ids for c in made], [c.logprobs for c in made],
                              [0.0] * 3, [True] * 3, seq_len=48)
  trainer = np.asarray(policy_logprobs(params, cfg, jax.tree.map(jnp.asarray, batch))[0])
  mask = batch.loss_mask > 0
  assert np.abs(trainer - batch.old_logp)[mask].max() < 1e-5
  # The trainer can place them: the router and the stacked experts have logical axes.
  axes = sharding.param_logical_axes(params)
  assert axes["layers_1"]["mlp"]["experts_down_proj"] == (sharding.EXPERTS, sharding.MLP,
                                                         sharding.EMBED)


def test_mixture_configs_that_cannot_run_are_refused():
  moe = MoeConfig(num_experts=4, experts_per_token=2, expert_size=8)
  common = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, intermediate_size=8)
  with pytest.raises(ValueError, match="the mixture-of-experts families .* and they alone"):
    ModelConfig(**common, moe=moe)
  with pytest.raises(ValueError, match="the mixture-of-experts families .* and they alone"):
    ModelConfig(**common, family="qwen3_moe")
  with pytest.raises(ValueError, match="experts_per_token=5 must be in"):
    MoeConfig(num_experts=4, experts_per_token=5, expert_size=8)
  with pytest.raises(ValueError, match="scoring='tanh'"):
    MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, scoring="tanh")
  with pytest.raises(ValueError, match="groups=3 must divide num_experts=4"):
    MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, groups=3)
  with pytest.raises(ValueError, match="1 of 4 groups hold fewer than experts_per_token=2"):
    MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, groups=4, top_groups=1)
  with pytest.raises(ValueError, match="shared_gate gates the shared expert: it needs"):
    MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_gate=True)
  # Multi-head latent attention: its family only, a key and a value for every head, rope dims
  # even and inside the key, values no wider than keys.
  mla = MlaConfig(kv_rank=4, rope_dim=2, value_dim=4)
  latent = {**common, "num_kv_heads": 2, "family": "deepseek_v3", "moe": moe}
  with pytest.raises(ValueError, match="the deepseek_v3 family, and it alone, has an MlaConfig"):
    ModelConfig(**latent)
  with pytest.raises(ValueError, match="num_kv_heads=1 must equal num_heads=2"):
    ModelConfig(**{**latent, "num_kv_heads": 1}, mla=mla)
  for bad, message in ((dict(rope_dim=3), "rope_dim=3 must be even"),
                       (dict(rope_dim=4), "rope_dim=4 must be even and below head_dim=4"),
                       (dict(value_dim=6), "value_dim=6 must be in")):
    with pytest.raises(ValueError, match=message):
      ModelConfig(**latent, mla=dataclasses.replace(mla, **bad))


def test_a_deepseek_checkpoint_loads_straight_into_its_expert_parallel_shards(deepseek):
  """hf.load with the shardings of an fsdp=2 x expert=2 x tensor=2 mesh: every tensor placed
  as param_shardings says (each device a quarter of the experts of a layer's stack), the
  values those of the plain load."""
  cfg, params = hf.load(deepseek[0])
  mesh = sharding.make_mesh(fsdp=2, expert=2, tensor=2)
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  shardings = sharding.param_shardings(shapes, mesh)
  _, placed = hf.load(deepseek[0], shardings=shardings)
  for (path, got), want, where in zip(jax.tree_util.tree_leaves_with_path(placed),
                                      jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert got.sharding.is_equivalent_to(where, got.ndim), path
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  up = placed["layers_1"]["mlp"]["experts_up_proj"]  # [8, 64, 32]: experts, fsdp, tensor
  assert up.addressable_shards[0].data.shape == (4, 32, 16)


def test_deepseek_checkpoints_that_route_otherwise_are_refused(deepseek, tmp_path):
  """DeepSeek's config.json fields that transformers ignores and SGLang reads are refused by
  name when they route otherwise; a router config.json cannot say is refused on export."""
  path, _ = deepseek
  config = json.load(open(os.path.join(path, "config.json")))
  for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"),
                     ("moe_layer_freq", 2)):
    with pytest.raises(hf.CheckpointError, match=f"{key}={value!r}: the deepseek_v3 family"):
      hf.config_from_hf({**config, key: value})
  cfg, params = hf.load(path)
  odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dense_layers=(1,)))
  with pytest.raises(ValueError, match="from first_k_dense_replace on"):
    hf.save(params, odd, str(tmp_path / "odd"))


@pytest.mark.parametrize("family,axes", [("qwen3_moe", dict(expert=8)),
                                         ("deepseek_v3", dict(fsdp=2, expert=2, tensor=2)),
                                         ("deepseek_v3", dict(data=2, expert=2, context=2))],
                         ids=["qwen3_moe, expert=8", "deepseek_v3, fsdp=2 x expert=2 x tensor=2",
                              "deepseek_v3, data=2 x expert=2 x context=2 (ring attention)"])
def test_an_expert_parallel_train_step_equals_one_device(family, axes):
  """The train step on 8 host devices with an expert axis (each device holding 8 / P experts,
  the tokens exchanged all-to-all; with tensor, each expert's columns split too) gives one
  device's loss and gradients; its experts really are split."""
  cfg = _small_mixture(VOCAB, family)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  batch = _packed_batch(rows=8, seq=24, vocab=VOCAB, seed=3)
  loss_fn, recorder = losses.bind("grpo", {"kl_coef": 0.0}), gradient_recorder()
  state = init_train_state(params, recorder)
  one, one_metrics = make_train_step(cfg, recorder, loss_fn)(state, batch)
  mesh = sharding.make_mesh(**axes)
  shardings = sharding.state_shardings(state, recorder, mesh)
  step = sharding.on_mesh(mesh, make_train_step(cfg, recorder, loss_fn,
                                                state_shardings=shardings))
  sharded, metrics = step(jax.device_put(state, shardings), batch)
  for key in ("loss", "grad_norm", "expert_load_cv"):
    np.testing.assert_allclose(metrics[key], one_metrics[key], rtol=1e-5, err_msg=key)
  assert_same_gradients(sharded.opt_state, one.opt_state)
  down = sharded.params["layers_1"]["mlp"]["experts_down_proj"]
  assert down.addressable_shards[0].data.shape[0] == 8 // axes["expert"]


def test_an_engine_on_an_expert_parallel_mesh_decodes_as_one_device():
  """Weights placed for training on fsdp=2 x expert=2 x tensor=2: the engine folds the expert
  axis into data (4 replicas of whole experts, each decoding its own rows) and generates what
  one device generates."""
  cfg = _small_mixture(VOCAB, "deepseek_v3")
  params = transformer.init_params(cfg, jax.random.PRNGKey(2))
  mesh = sharding.make_mesh(fsdp=2, expert=2, tensor=2)
  engine = JaxEngine(cfg, jax.device_put(params, sharding.param_shardings(params, mesh)))
  down = engine.params["layers_1"]["mlp"]["experts_down_proj"]
  assert down.addressable_shards[0].data.shape[0] == 8  # every expert on every replica
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23], [1, 3, 3]] * 2
  greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
  want = JaxEngine(cfg, params).generate(prompts, greedy, seed=0)
  for a, b in zip(want, engine.generate(prompts, greedy, seed=0)):
    assert a.token_ids.tolist() == b.token_ids.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_expert_parallel_experts_are_dropless_and_drop_per_device_with_a_capacity():
  """expert_parallel_experts on an expert axis of 4 devices (2 rows each) equals
  dropless_experts; with a capacity factor each device takes ceil(f T_local k / 4) pairs from
  each peer, in token order, and each of its experts ceil(f T_local k / 2) of those, and the
  rest are dropped (the token keeps its other experts)."""
  rng = np.random.default_rng(6)
  rows, seq, hidden, size, k, num = 8, 6, 8, 12, 2, 8
  x = rng.normal(size=(rows, seq, hidden)).astype(np.float32)
  experts = np.stack([rng.choice(num, k, replace=False) for _ in range(rows * seq)]).reshape(
      rows, seq, k).astype(np.int32)
  experts[:2, :, 0] = 0  # device 0's rows crowd expert 0 (held by device 0)
  weights = rng.uniform(size=(rows, seq, k)).astype(np.float32)
  gate, up = (rng.normal(size=(num, hidden, size)).astype(np.float32) for _ in range(2))
  down = rng.normal(size=(num, size, hidden)).astype(np.float32)
  flat = lambda a: a.reshape(rows * seq, -1)
  dropless = lambda w: np.asarray(mixture.dropless_experts(
      flat(x), flat(experts), flat(w), gate, up, down)).reshape(rows, seq, hidden)
  with jax.set_mesh(sharding.make_mesh(expert=4)):
    parallel = jax.jit(mixture.expert_parallel_experts, static_argnames="capacity_factor")
    np.testing.assert_allclose(parallel(x, experts, weights, gate, up, down), dropless(weights),
                               rtol=1e-5, atol=1e-5)
    dropped = parallel(x, experts, weights, gate, up, down, capacity_factor=1.0)
  # Room for ceil(1.0 * 12 * 2 / 4) = 6 pairs per (sender, receiver): the pairs past it, in
  # the sender's (token, slot) order, add nothing; then each expert keeps the first
  # ceil(1.0 * 12 * 2 / 2) = 12 of those its device received, in (sender, slot) order.
  kept, pairs = weights.copy(), experts.reshape(-1, k)
  arrived = {receiver: [] for receiver in range(4)}
  for sender in range(4):
    queue = {}
    for t in range(2 * sender * seq, 2 * (sender + 1) * seq):
      for j in range(k):
        receiver = pairs[t, j] // 2
        queue[receiver] = queue.get(receiver, 0) + 1
        if queue[receiver] > 6:
          kept.reshape(-1, k)[t, j] = 0.0
        else:
          arrived[receiver].append((t, j))
  per_peer = (kept != weights).sum()
  for receiver, arrivals in arrived.items():
    taken = {}
    for t, j in arrivals:
      taken[pairs[t, j]] = taken.get(pairs[t, j], 0) + 1
      if taken[pairs[t, j]] > 12:
        kept.reshape(-1, k)[t, j] = 0.0
  assert 0 < per_peer < (kept != weights).sum()  # both rooms dropped some pairs
  np.testing.assert_allclose(dropped, dropless(kept), rtol=1e-5, atol=1e-5)


def _rows():
  tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 10))
  segments = np.ones((2, 10), np.int32)
  segments[1, 7:] = 0  # padding
  return tuple(map(jnp.asarray, (tokens, np.arange(10)[None].repeat(2, 0), segments)))


def test_routes_are_returned_and_replayed_routes_are_followed(checkpoint):
  """forward_with_routes gives the router's choices per sparse layer; replaying them changes
  nothing, replaying others routes there (weights: the trainer's softmax at those experts,
  renormalised), and a row of negative ids routes natively."""
  cfg, params = hf.load(checkpoint[0])
  tokens, positions, segments = _rows()
  hidden, route = transformer.forward_with_routes(params, cfg, tokens, positions, segments)
  assert route.experts.shape == (2, 10, 1, 2) and route.entropy.shape == (2, 10, 1)
  np.testing.assert_array_equal(route.experts, route.native)
  assert np.all((route.entropy > 0) & (route.entropy <= np.log(8) + 1e-5))
  np.testing.assert_array_equal(
      transformer.forward_with_routes(params, cfg, tokens, positions, segments,
                                      replay=route.experts)[0], hidden)
  # Every token of row 0 to experts 6 and 7; row 1 marked native (-1).
  replay = np.full((2, 10, 1, 2), -1, np.int32)
  replay[0] = [6, 7]
  replayed, again = transformer.forward_with_routes(params, cfg, tokens, positions, segments,
                                                    replay=jnp.asarray(replay))
  np.testing.assert_array_equal(again.experts[0], np.broadcast_to([6, 7], (10, 1, 2)))
  np.testing.assert_array_equal(again.experts[1], route.native[1])
  np.testing.assert_array_equal(again.native, route.native)
  np.testing.assert_allclose(replayed[1], hidden[1], atol=1e-6)
  assert np.abs(np.asarray(replayed[0]) - np.asarray(hidden[0])).max() > 1e-3
  # Row 0's sparse layer by hand: the dropless experts on 6 and 7, the softmax weights there.
  mlp = params["layers_1"]["mlp"]
  layer_in = _layer_input(params, cfg, tokens, positions, segments)[0]  # [10, H]
  probs = jax.nn.softmax(layer_in @ mlp["gate"]["kernel"], axis=-1)[:, 6:8]
  want = _reference_experts(layer_in, np.full((10, 2), [6, 7]),
                            probs / probs.sum(-1, keepdims=True), mlp["experts_gate_proj"],
                            mlp["experts_up_proj"], mlp["experts_down_proj"])
  got = _sparse_output(params, cfg, layer_in, jnp.full((1, 10, 2), jnp.array([6, 7])))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The router still learns under replay: its weights come from its softmax.
  grad = jax.grad(lambda p: jnp.sum(transformer.forward_with_routes(
      p, cfg, tokens, positions, segments, replay=jnp.asarray(replay))[0] ** 2))(params)
  assert np.abs(np.asarray(grad["layers_1"]["mlp"]["gate"]["kernel"])).max() > 0


def _layer_input(params, cfg, tokens, positions, segments):
  """The sparse layer's (layer 1's) MoE input: layer 0, attention of layer 1, its norm."""
  x = params["embed_tokens"]["embedding"][tokens]
  x, _, _ = transformer.Block(cfg, 0).apply({"params": params["layers_0"]}, x, positions,
                                            segments)
  block = params["layers_1"]
  norm = lambda name, x: layers.RMSNorm(cfg.rms_norm_eps).apply(
      {"params": block[name]}, x)
  h, _ = transformer.Attention(cfg, 1).apply({"params": block["self_attn"]},
                                             norm("input_layernorm", x), positions, segments)
  return norm("post_attention_layernorm", x + h)


def _sparse_output(params, cfg, layer_in, replay):
  return mixture.MoE(cfg).apply({"params": params["layers_1"]["mlp"]}, layer_in[None],
                                    replay)[0][0]


def test_remat_scans_each_run_of_alike_layers_as_the_unrolled_layers(checkpoint, deepseek):
  """With remat the layers run as one scan per run of alike layers: the Qwen3-MoE's dense,
  sparse, dense (three scans), the DeepSeek-V3's dense first layer then two sparse (two), and
  the Qwen3-MoE with every layer sparse (one). Hidden states and routes equal the unrolled
  layers', with and without replayed routes."""
  cfg, params = hf.load(checkpoint[0])
  sparse = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, sparse_step=1))
  alike = {**params, **{f"layers_{i}": params["layers_1"] for i in range(3)}}
  tokens, positions, segments = _rows()
  rng = np.random.default_rng(5)
  for cfg, params in ((cfg, params), hf.load(deepseek[0]), (sparse, alike)):
    assert [len(run) for run in transformer.alike_runs(cfg)] == (
        [1, 1, 1] if cfg.sparse_layers == (1,) else [1, 2] if cfg.mla else [3])
    layers = len(cfg.sparse_layers)
    replay = jnp.asarray(np.stack([rng.permutation(8)[:2] for _ in range(layers)])
                         * np.ones((2, 10, 1, 1), np.int32), jnp.int32)
    for r in (None, replay):
      want = transformer.forward_with_routes(params, cfg, tokens, positions, segments, r)
      got = transformer.forward_with_routes(params, dataclasses.replace(cfg, remat="full"),
                                            tokens, positions, segments, r)
      np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
      for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_routing_metrics_on_hand_made_routes():
  # 2 rows x 4 tokens, one layer, k = 2 of E = 4; row 1's last two tokens are padding.
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
  balanced = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]],
                        [[0, 2], [1, 3], [0, 0], [0, 0]]], jnp.int32)[:, :, None]
  entropy = jnp.full((2, 4, 1), 0.5)
  m = mixture.routing_metrics(mixture.Route(balanced, balanced, entropy, entropy), mask,
                                  4)
  assert float(m["expert_load_cv"]) == pytest.approx(0.0)
  assert float(m["expert_load_max"]) == pytest.approx(1.0)
  assert float(m["router_entropy"]) == pytest.approx(0.5)
  assert "routing_differs" not in m  # no engine routes to compare with
  # Every real token to experts 0 and 1 (two of four: max share 1/2, times E = 2).
  collapsed = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (2, 4, 1, 2))
  m = mixture.routing_metrics(mixture.Route(collapsed, balanced, entropy, entropy), mask,
                                  4)
  assert float(m["expert_load_cv"]) == pytest.approx(1.0)  # counts 6, 6, 0, 0
  assert float(m["expert_load_max"]) == pytest.approx(2.0)
  # The engine's routes: row 0's first token lists 0 and 1 in the other order (the same
  # set), row 0's last was not recorded (-1), row 1's padding is anything. Of the 5 recorded
  # real tokens, the experts taken (collapsed) differ on 3 ([2, 3], [0, 2], [1, 2]) and the
  # router's own (balanced) on 1 (row 1's second, [1, 3] against [1, 2]).
  engine = balanced.at[0, 0, 0].set(jnp.array([1, 0])).at[0, 3, 0].set(-1)
  engine = engine.at[1, 1, 0].set(jnp.array([1, 2])).at[1, 2, 0].set(jnp.array([3, 3]))
  m = mixture.routing_metrics(mixture.Route(collapsed, balanced, entropy, entropy), mask,
                                  4, engine)
  assert float(m["routing_differs"]) == pytest.approx(3 / 5)
  assert float(m["router_differs"]) == pytest.approx(1 / 5)
  # The balance loss: 1 for uniform scores on a balanced load, 2 when the real tokens' load
  # and scores gather on experts 0 and 1 (the padding token's choice not counted).
  uniform, gathered = jnp.full((4, 4), 0.25), jnp.array([[0.5, 0.5, 0.0, 0.0]] * 4)
  terms = lambda probs, native, real: mixture.balance_terms(
      probs, jnp.asarray(native), jnp.asarray(real, jnp.float32), 4)
  np.testing.assert_allclose(terms(uniform, balanced[0, :, 0], [1, 1, 1, 1]), 1.0)
  np.testing.assert_allclose(terms(gathered, [[0, 1], [0, 1], [0, 1], [2, 3]], [1, 1, 1, 0]),
                             2.0)
  assert float(m["expert_balance_loss"]) == pytest.approx(0.5)  # the real tokens' mean term


def test_deepseek_v3_routing_and_shared_experts_equal_transformers():
  """MoE with DeepSeek-V3's router (sigmoid scores, a correction bias for the choice only,
  the experts of the best 2 of 4 groups eligible, renormalised weights times 2.5) and a
  shared expert equals transformers' DeepseekV3MoE in float32, and chooses its experts."""
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek
  hidden, size, experts = 16, 8, 8
  config = transformers.DeepseekV3Config(
      hidden_size=hidden, moe_intermediate_size=size, n_routed_experts=experts,
      num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
      routed_scaling_factor=2.5, norm_topk_prob=True)
  torch.manual_seed(0)
  theirs = deepseek.DeepseekV3MoE(config).eval()
  with torch.no_grad():
    for p in theirs.parameters():
      p.normal_(0.0, 0.5)
    theirs.gate.e_score_correction_bias.normal_(0.0, 0.3)
  t = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
  ours = {"gate": {"kernel": t["gate.weight"].T},
          "e_score_correction_bias": t["gate.e_score_correction_bias"],
          "experts_gate_proj": t["experts.gate_up_proj"][:, :size].transpose(0, 2, 1),
          "experts_up_proj": t["experts.gate_up_proj"][:, size:].transpose(0, 2, 1),
          "experts_down_proj": t["experts.down_proj"].transpose(0, 2, 1),
          "shared_experts": {name: {"kernel": t[f"shared_experts.{name}.weight"].T}
                             for name in ("gate_proj", "up_proj", "down_proj")}}
  moe = MoeConfig(num_experts=experts, experts_per_token=2, expert_size=size,
                  normalize_weights=True, scoring="sigmoid", correction_bias=True, groups=4,
                  top_groups=2, scaling=2.5, shared_size=size)
  cfg = ModelConfig(family="qwen3_moe", vocab_size=VOCAB, hidden_size=hidden, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                    qkv_bias=False, moe=moe)
  x = np.random.default_rng(0).normal(size=(2, 5, hidden)).astype(np.float32)
  out, route = mixture.MoE(cfg).apply({"params": ours}, jnp.asarray(x))
  with torch.no_grad():
    want = theirs(torch.tensor(x)).numpy()
    _, _, chosen = theirs.gate(torch.tensor(x))
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.sort(np.asarray(route.native).reshape(-1, 2), -1),
                                np.sort(chosen.numpy(), -1))
  # The groups mattered: some token's two best biased scores lie outside its best groups.
  biased = 1 / (1 + np.exp(-x.reshape(-1, hidden) @ t["gate.weight"].T))
  biased += t["gate.e_score_correction_bias"]
  ungrouped = np.sort(np.argsort(-biased, -1)[:, :2], -1)
  assert (ungrouped != np.sort(chosen.numpy(), -1)).any()


def test_loss_free_balancing_moves_the_correction_bias_against_the_load():
  """make_train_step(expert_bias_rate=r) on DeepSeek-V3's router: after the update each
  sparse layer's correction bias is its old value + r * sign(mean load - load), the loads
  counted over the real tokens of every micro-batch at the step's starting params; the
  gradient never moves it (without the rate it stays 0); a model without one is refused."""
  moe = MoeConfig(num_experts=8, experts_per_token=2, expert_size=16, scoring="sigmoid",
                  correction_bias=True, groups=2, top_groups=1, dense_layers=(0,))
  cfg = tiny(VOCAB, hidden_size=32, intermediate_size=64, moe=moe)
  params = transformer.init_params(cfg, jax.random.PRNGKey(2))
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, VOCAB, 6).tolist() for _ in range(6)]
  completions = [rng.integers(1, VOCAB, n).tolist() for n in (9, 4, 12, 7, 3, 10)]
  batch, _ = trajectory_batch(prompts, completions, [np.full(len(c), -2.0) for c in completions],
                              rng.normal(size=6), [True] * 6, 24, row_multiple=4)
  batch = jax.tree.map(jnp.asarray, batch)
  _, route = transformer.forward_with_routes(params, cfg, batch.tokens, batch.positions,
                                             batch.segment_ids)
  load = np.asarray(mixture.expert_counts(route, batch.segment_ids > 0, 8))[0]
  want = 0.01 * np.sign(load.mean() - load)
  assert (want > 0).any() and (want < 0).any()
  optimizer = optax.adamw(1e-3)
  for rate, expected in ((0.01, want), (0.0, np.zeros(8))):
    step = make_train_step(cfg, optimizer, losses.bind("k1.5"), micro_batches=2,
                           expert_bias_rate=rate)
    state, _ = step(init_train_state(params, optimizer), batch)
    np.testing.assert_allclose(state.params["layers_1"]["mlp"]["e_score_correction_bias"],
                               expected, atol=1e-7)
  with pytest.raises(ValueError, match="the model has none"):
    make_train_step(_small_mixture(VOCAB), optimizer, losses.bind("k1.5"), expert_bias_rate=0.1)
  with pytest.raises(ValueError, match="qwen3_moe's config.json holds no sigmoid scoring"):
    hf.save(params, cfg, "/nonexistent")  # refused before anything is written


def test_the_load_balancing_loss_is_transformers_and_its_gradient_joins_the_step(checkpoint):
  """balance_loss on the Qwen3-MoE checkpoint (one sparse layer) is transformers' aux_loss
  over the same unpadded tokens divided by k; make_train_step(balance_coef=c) takes c times
  its gradient beside the policy loss's (micro-batches counted as the loss counts them); a
  dense model is refused."""
  path, model = checkpoint
  cfg, params = hf.load(path)
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, VOCAB, (3, 16))
  mask = np.array([[1] * n + [0] * (16 - n) for n in (16, 11, 5)])
  with torch.no_grad():
    theirs = model(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                   output_router_logits=True).aux_loss.item()
  _, route = transformer.forward_with_routes(params, cfg, jnp.asarray(tokens * mask),
                                             jnp.asarray(np.arange(16)[None].repeat(3, 0)),
                                             jnp.asarray(mask))
  ours = float(mixture.balance_loss(route, jnp.asarray(mask) > 0))
  assert ours == pytest.approx(theirs / 2, rel=1e-5) and ours > 1.0

  small = _small_mixture(VOCAB)
  params = transformer.init_params(small, jax.random.PRNGKey(4))
  batch = _packed_batch(rows=4, seq=24, vocab=VOCAB, seed=8)
  loss_fn, recorder = losses.bind("grpo", {"kl_coef": 0.0}), gradient_recorder()
  state = init_train_state(params, recorder)
  step = lambda coef: make_train_step(small, recorder, loss_fn, micro_batches=2,
                                      balance_coef=coef)(state, batch)
  (plain, plain_metrics), (balanced, metrics) = step(0.0), step(0.5)

  def loss(p):
    _, route = transformer.forward_with_routes(p, small, batch.tokens, batch.positions,
                                               batch.segment_ids)
    return mixture.balance_loss(route, batch.segment_ids > 0)

  # Each micro-batch's own loss, weighted by its share of the loss's count (GRPO's: its
  # sequences, whatever the log-probs).
  halves = [jax.tree.map(lambda x: x[i:i + 2], batch) for i in (0, 2)]
  counts = [float(loss_fn(h.old_logp, h)[0].count) for h in halves]
  grads = [jax.grad(lambda p, h=h: mixture.balance_loss(
      transformer.forward_with_routes(p, small, h.tokens, h.positions, h.segment_ids)[1],
      h.segment_ids > 0))(params) for h in halves]
  want = jax.tree.map(lambda g0, a, b: g0 + 0.5 * (counts[0] * a + counts[1] * b) / sum(counts),
                      plain.opt_state, *grads)
  assert_same_gradients(balanced.opt_state, want)
  gate = lambda s: np.asarray(s.opt_state["layers_1"]["mlp"]["gate"]["kernel"])
  assert np.abs(gate(balanced) - gate(plain)).max() > 1e-3 * np.abs(gate(plain)).max()
  assert metrics["loss"] == plain_metrics["loss"]  # the policy's loss, logged alone
  assert float(metrics["expert_balance_loss"]) == pytest.approx(float(loss(params)), rel=0.05)
  with pytest.raises(ValueError, match="the model is dense"):
    make_train_step(tiny(VOCAB), recorder, loss_fn, balance_coef=0.1)


def _small_mixture(vocab_size: int, family: str = "qwen3_moe") -> ModelConfig:
  """The tiny config's Qwen3-MoE at the size of the tests' tiny model: layer 1 sparse, 8
  experts, 2 a token; or a DeepSeek-V3 of that size (latent attention, its router in 2
  groups, a shared expert)."""
  if family == "qwen3_moe":
    return tiny(vocab_size, hidden_size=32, intermediate_size=64,
                moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=16,
                              dense_layers=(0,)))
  return ModelConfig(
      family=family, vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=4, head_dim=12, intermediate_size=64, qkv_bias=False,
      moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=16, dense_layers=(0,),
                    normalize_weights=True, scoring="sigmoid", correction_bias=True, groups=2,
                    top_groups=1, scaling=2.0, shared_size=16),
      mla=MlaConfig(kv_rank=8, rope_dim=4, value_dim=8, q_rank=16))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_an_rl_step_on_a_mixture_logs_its_routing(tokenizer, family):
  """The loop on a small Qwen3-MoE or DeepSeek-V3 (embedded engine, k1.5): its train step
  logs the routing over the batch's real tokens, and the router is trained."""
  cfg = _small_mixture(tokenizer.vocab_size, family)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  config = RLConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6, seq_len=32)
  steps, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, params), tokenizer=tokenizer,
                           task=Arithmetic(digits=1, operands=2), loss="k1.5", config=config)
  record = next(steps)
  assert 0.0 <= record.metrics["expert_load_cv"] <= np.sqrt(7)
  assert 1.0 <= record.metrics["expert_load_max"] <= 8 / 2
  assert 0.0 < record.metrics["router_entropy"] <= np.log(8)
  trained = record.state.train.params["layers_1"]["mlp"]
  assert np.abs(np.asarray(trained["gate"]["kernel"])
                - np.asarray(params["layers_1"]["mlp"]["gate"]["kernel"])).max() > 0


def test_routing_replay_in_the_loop(tokenizer):
  """The embedded engine in bf16, the trainer in float32: the same first step (the same
  rollouts) without and with routing replay. The trajectories keep the engine's routes of
  every input token, the batch carries them; without replay the trainer routes some tokens
  otherwise than the engine did and its log-probs differ more; with replay it routes none
  otherwise, while its router alone would route the same tokens otherwise as before (one
  sparse layer: the replay cannot change its input)."""
  cfg = _small_mixture(tokenizer.vocab_size)
  params = transformer.init_params(cfg, jax.random.PRNGKey(1))
  config = RLConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, seq_len=32,
                    minibatches=1)
  first = {}
  for replay in (False, True):
    steps, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, params, dtype="bfloat16"),
                             tokenizer=tokenizer, task=Arithmetic(digits=1, operands=2),
                             loss="k1.5", config=config, replay=replay)
    first[replay] = next(steps)
  off, on = first[False], first[True]
  assert [t.token_ids for t in off.trajectories] == [t.token_ids for t in on.trajectories]
  for t in on.trajectories:
    assert t.routed_experts.shape == (len(t.prompt_ids) + len(t.token_ids) - 1, 1, 2)
  assert off.metrics["routing_differs"] > 0
  assert off.metrics["router_differs"] == off.metrics["routing_differs"]
  assert on.metrics["routing_differs"] == 0.0
  assert on.metrics["router_differs"] == pytest.approx(off.metrics["routing_differs"])
  assert on.metrics["engine_logp_diff_mean"] < off.metrics["engine_logp_diff_mean"]
  assert on.metrics["engine_logp_diff_max"] < off.metrics["engine_logp_diff_max"]


def test_the_batch_carries_each_trajectorys_routes_at_its_tokens():
  """rl.batch packs routed_experts with the tokens they routed: a trajectory's whole
  sequence (prompt and continuation but the last token), -1 past what the engine reported
  (an environment's last observation) and for a trajectory it reported none of; 0 on
  padding. Replay then needs them: a batch without any is refused."""
  layers, k = 2, 3
  reported = [np.arange(8 * layers * k, dtype=np.int32).reshape(8, layers, k),
              np.full((3, layers, k), 7, np.int32)]
  trajectories = [
      Trajectory({}, (1, 2, 3), group=0, token_ids=[4, 5, 6, 7, 8, 9], logprobs=[0.0] * 6,
                  versions=[0] * 6, policy_mask=[True] * 6, routed_experts=reported[0]),
      Trajectory({}, (1, 2), group=0, token_ids=[4, 5, 6], logprobs=[0.0] * 3,
                  versions=[0] * 3, policy_mask=[True, True, False], routed_experts=reported[1]),
      Trajectory({}, (1, 2), group=0, token_ids=[4], logprobs=[0.0], versions=[0],
                  policy_mask=[True])]
  fields = batch_lib.trajectory_fields(trajectories, frozenset())
  [batch] = batch_lib.minibatches(trajectories, np.zeros(3), [np.ones(len(t.token_ids), bool)
                                                              for t in trajectories],
                                  RLConfig(seq_len=16), fields)
  routes = np.asarray(batch.routed_experts)
  assert routes.shape == batch.tokens.shape + (layers, k)
  want = [reported[0], np.concatenate([reported[1], np.full((1, layers, k), -1)]),
          np.full((2, layers, k), -1)]
  segments = {}  # a segment's input tokens -> its routes
  for row, ids in enumerate(np.asarray(batch.segment_ids)):
    for segment in set(ids.tolist()) - {0}:
      where = np.flatnonzero(ids == segment)
      segments[tuple(np.asarray(batch.tokens)[row, where].tolist())] = routes[row, where]
  for t, expected in zip(trajectories, want):
    inputs = (list(t.prompt_ids) + t.token_ids)[:-1]
    np.testing.assert_array_equal(segments[tuple(inputs)], expected)
  np.testing.assert_array_equal(routes[np.asarray(batch.segment_ids) == 0], 0)
  assert "routed_experts" not in batch_lib.trajectory_fields(trajectories[2:], frozenset())
  with pytest.raises(ValueError, match="engine reported none"):
    replayed_routes(batch.replace(routed_experts=None), True)


def _routes_of(params, cfg, sequence) -> np.ndarray:
  """The experts a forward pass over `sequence` sends each token but the last to, as sets:
  i32[len - 1, sparse layers, k] sorted along k."""
  n = len(sequence)
  _, route = transformer.forward_with_routes(params, cfg, jnp.asarray([sequence]),
                                             jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
  return np.sort(np.asarray(route.experts[0, :n - 1]), axis=-1)


def test_the_server_returns_routed_experts_as_sglang_does(checkpoint, tmp_path):
  """rollouts.server with --enable-return-routed-experts answers return_routed_experts as
  SGLang 0.5.23 does (moe.md section 4): meta_info.routed_experts, base64 of int32 [prompt +
  completion - 1 - start_len, every layer, k] (the dense layers' 0), from
  routed_experts_start_len on, a start past the prompt refused with SGLang's message; a
  resumed request's prefix from the cache keeps the routes it was computed with; without the
  flag, or without asking, no field. The client reads them into Completion.routed_experts
  (the sparse layers'), which equal the experts a forward pass chooses."""
  cfg, params = hf.load(checkpoint[0])
  prompt = [5, 17, 33, 2]

  def ask(url, **extra):
    return httpx.post(url + "/generate", timeout=60, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
        **extra})

  with helpers.serving(cfg, params, return_routed_experts=True) as (url, _):
    reply = ask(url, return_routed_experts=True).json()
    sequence = prompt + reply["output_ids"]
    rows = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), "<i4")
    rows = rows.reshape(len(sequence) - 1, 3, 2)
    assert not rows[:, [0, 2]].any()  # layers 0 and 2 are dense
    np.testing.assert_array_equal(np.sort(rows[:, 1:2], -1), _routes_of(params, cfg, sequence))
    late = ask(url, return_routed_experts=True, routed_experts_start_len=3).json()
    assert len(base64.b64decode(late["meta_info"]["routed_experts"])) == (
        len(prompt) + len(late["output_ids"]) - 1 - 3) * 3 * 2 * 4
    refused = ask(url, return_routed_experts=True, routed_experts_start_len=5)
    assert refused.status_code == 400
    assert "routed_experts_start_len=5 is higher than the number of input tokens" in (
        refused.json()["error"]["message"])
    assert "routed_experts" not in ask(url).json()["meta_info"]
    assert httpx.get(url + "/server_info").json()["enable_return_routed_experts"] is True
    # A request aborted mid-way leaves its prefix cached; resumed, the routes come from there.
    out = {}
    thread = threading.Thread(target=lambda: out.update(reply=ask(
        url, rid="long", return_routed_experts=True,
        sampling_params={"max_new_tokens": 1000}).json()))
    thread.start()
    deadline = time.monotonic() + 60
    while not httpx.get(url + "/v1/loads").json()["loads"][0]["num_running_reqs"]:
      assert time.monotonic() < deadline, "the long request never ran"
      time.sleep(0.02)
    httpx.post(url + "/abort_request", json={"rid": "long"})
    thread.join(60)
    partial = out["reply"]
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    resumed = ask(url, input_ids=prompt + partial["output_ids"], return_routed_experts=True)
    resumed = resumed.json()
    assert resumed["meta_info"]["cached_tokens"] == len(prompt) + len(partial["output_ids"])
    for sent, reply in ((prompt, partial), (prompt + partial["output_ids"], resumed)):
      sequence = sent + reply["output_ids"]
      rows = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), "<i4")
      np.testing.assert_array_equal(np.sort(rows.reshape(-1, 3, 2)[:, 1:2], -1),
                                    _routes_of(params, cfg, sequence))
    engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir=str(tmp_path))
    try:
      made = engine.generate([prompt, prompt[:2]], SamplingParams(5), seed=0)
    finally:
      engine.close()
    for sent, completion in zip((prompt, prompt[:2]), made):
      np.testing.assert_array_equal(
          np.sort(completion.routed_experts, -1),
          _routes_of(params, cfg, sent + completion.token_ids.tolist()))
  with helpers.serving(cfg, params) as (url, _):
    assert "routed_experts" not in ask(url, return_routed_experts=True).json()["meta_info"]


def test_the_engine_records_where_it_routed_each_token_as_the_trainer_routes_it(checkpoint):
  """Completion.routed_experts (SGLang's layout: prompt and completion tokens but the last)
  from the embedded engine's prefill and decode steps equal the experts a forward pass over
  prompt + completion chooses, prompts of different lengths in one batch (left padding),
  limits cut alike; a dense model records none."""
  cfg, params = hf.load(checkpoint[0])
  prompts = [[5, 17, 33, 2], [40, 41], [7] * 9]
  made = JaxEngine(cfg, params).generate(prompts, SamplingParams(12, temperature=1.0), seed=1,
                                         max_new_tokens=[12, 5, 12])
  for prompt, completion in zip(prompts, made):
    sequence = np.concatenate([prompt, completion.token_ids])[None]
    n = sequence.shape[1]
    _, route = transformer.forward_with_routes(params, cfg, jnp.asarray(sequence),
                                               jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
    assert completion.routed_experts.shape == (n - 1, 1, 2)
    np.testing.assert_array_equal(completion.routed_experts, route.native[0, :n - 1])
  assert len(made[1].token_ids) == 5
  dense = dataclasses.replace(cfg, family="qwen3", moe=None)
  dense_params = {**params, "layers_1": params["layers_0"]}
  assert JaxEngine(dense, dense_params).generate(
      prompts, SamplingParams(4), seed=0)[0].routed_experts is None
