"""Mixtures of experts (models/transformer.py MoE, the qwen3_moe family): dropless expert
computation against a token-by-token reference, Qwen3-MoE's logits against transformers in
float32 on padded and packed rows, the engine and the trainer computing the same log-probs, and
the configurations that cannot run refused. tests/test_hf.py runs the family through every
Hugging Face check the dense families pass (greedy generation, exports, bf16)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra pins the CPU wheel
import transformers

from models import hf, sharding, transformer
from models.config import ModelConfig, MoeConfig
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

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
  np.testing.assert_allclose(transformer.dropless_experts(*args), _reference_experts(*args),
                             rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda x, w, g, u, d: jnp.sum(f(x, experts, w, g, u, d) ** 2)
  wrt = (0, 1, 2, 3, 4)
  got = jax.grad(loss(transformer.dropless_experts), wrt)(x, weights, gate, up, down)
  want = jax.grad(loss(_reference_experts), wrt)(x, weights, gate, up, down)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(got[2][4]) == 0)  # an expert no token chose gets no gradient


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
  assert axes["layers_1"]["mlp"]["experts_down_proj"] == (None, sharding.MLP, sharding.EMBED)


def test_remat_scans_a_mixture_whose_layers_are_alike_and_refuses_mixed_ones(checkpoint):
  cfg, params = hf.load(checkpoint[0])
  tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 10))
  positions, segments = np.arange(10)[None].repeat(2, 0), np.ones((2, 10), np.int32)
  with pytest.raises(ValueError, match="every layer dense or every layer sparse"):
    _logits(params, dataclasses.replace(cfg, remat="full"), tokens, positions, segments)
  # Every layer sparse: one layer's params copied into the others' places.
  sparse = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, sparse_step=1))
  alike = {**params, **{f"layers_{i}": params["layers_1"] for i in range(3)}}
  np.testing.assert_allclose(
      _logits(alike, dataclasses.replace(sparse, remat="full"), tokens, positions, segments),
      _logits(alike, sparse, tokens, positions, segments), atol=1e-5, rtol=0)


def test_mixture_configs_that_cannot_run_are_refused():
  moe = MoeConfig(num_experts=4, experts_per_token=2, expert_size=8)
  common = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, intermediate_size=8)
  with pytest.raises(ValueError, match="the qwen3_moe family, and it alone"):
    ModelConfig(**common, moe=moe)
  with pytest.raises(ValueError, match="the qwen3_moe family, and it alone"):
    ModelConfig(**common, family="qwen3_moe")
  with pytest.raises(ValueError, match="experts_per_token=5 must be in"):
    MoeConfig(num_experts=4, experts_per_token=5, expert_size=8)
