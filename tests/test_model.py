"""The decoder, its log-probs, and the embedded engine agree with each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config, layers, logprobs, rope, transformer
from models.attention import reference
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine


def _uncached_greedy(params, cfg, prompt, steps):
  """Greedy decoding that re-runs the full forward pass over the whole sequence each step
  (a fixed-length buffer; positions after the sequence are padding, segment 0)."""
  length = len(prompt) + steps
  forward = jax.jit(transformer.forward, static_argnums=1)
  seq = list(prompt)
  for _ in range(steps):
    tokens = jnp.asarray([seq + [0] * (length - len(seq))], jnp.int32)
    segments = (jnp.arange(length) < len(seq)).astype(jnp.int32)[None]
    hidden = forward(params, cfg, tokens, jnp.arange(length)[None], segments)
    logits = hidden[0, len(seq) - 1] @ transformer.output_projection(params, cfg)
    seq.append(int(jnp.argmax(logits)))
  return seq[len(prompt):]


def test_cached_greedy_equals_uncached(tiny_cfg, tiny_params):
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23, 24, 25]]  # different lengths: padding
  engine = JaxEngine(tiny_cfg, tiny_params)
  out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0), seed=0)
  for prompt, completion in zip(prompts, out):
    assert completion.finish_reason == "length"
    assert completion.token_ids.tolist() == _uncached_greedy(tiny_params, tiny_cfg, prompt, 12)


def test_engine_logprobs_equal_trainer_logprobs(tiny_cfg, tiny_params):
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23, 24, 25], [1, 3, 3]]
  engine = JaxEngine(tiny_cfg, tiny_params)
  out = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0,
                                                stop_token_ids=(2,)), seed=3)
  batch, placements = trajectory_batch(
      prompts, [c.token_ids for c in out], [c.logprobs for c in out], [0.0] * 4, [True] * 4,
      seq_len=32)
  logp, _ = policy_logprobs(tiny_params, tiny_cfg, jax.tree.map(jnp.asarray, batch))
  mask = batch.loss_mask > 0
  assert mask.sum() == sum(len(c.token_ids) for c in out)
  diff = np.abs(np.asarray(logp) - batch.old_logp)[mask]
  assert diff.max() <= 1e-4, diff.max()


def test_sampling_respects_stop_tokens_and_versions(tiny_cfg, tiny_params):
  engine = JaxEngine(tiny_cfg, tiny_params, version=7)
  # Stopping on every token id ends each completion after exactly one token.
  every = tuple(range(tiny_cfg.vocab_size))
  out = engine.generate([[1, 4]] * 3, SamplingParams(max_new_tokens=5, stop_token_ids=every),
                        seed=1)
  for c in out:
    assert c.finish_reason == "stop" and len(c.token_ids) == 1
    assert c.versions.tolist() == [7]
  engine.update_weights(tiny_params, version=8)
  assert engine.generate([[1]], SamplingParams(max_new_tokens=2), seed=0)[0].versions.tolist() \
      == [8, 8]


def test_engine_limits_each_prompt_to_its_own_max_new_tokens(tiny_cfg, tiny_params):
  """Per-prompt limits: greedy decoding gives each prompt the prefix of what it makes with the
  largest limit, cut at its own ("length"); the embedded engine cannot abort."""
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21], [1, 3, 3]]
  engine = JaxEngine(tiny_cfg, tiny_params)
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  whole = engine.generate(prompts, greedy, seed=0)
  limits = [12, 3, 5, 1]
  ready = {}
  cut = engine.generate(prompts, greedy, seed=0, max_new_tokens=limits, on_ready=ready.update)
  assert sorted(ready) == [0, 1, 2, 3]
  for full, part, limit in zip(whole, cut, limits):
    assert part.token_ids.tolist() == full.token_ids[:limit].tolist()
    assert part.finish_reason == "length" and len(part.versions) == limit
  assert not engine.capabilities.abort and engine.capabilities.keeps_weight_arrays
  with pytest.raises(ValueError, match="cannot abort"):
    engine.generate(prompts, greedy, seed=0, stop_when=lambda i, c: True)
  with pytest.raises(ValueError, match=r"a limit in \[1, 12\]"):
    engine.generate(prompts, greedy, seed=0, max_new_tokens=[13, 1, 1, 1])


def test_a_kv_cache_budget_decodes_in_batches_with_the_same_tokens(tiny_cfg, tiny_params):
  """kv_cache_gib bounds one batch's cache: 20 prompts of a 16-token bucket + 12 new tokens
  (28 slots of 2 x 2 layers x 2 KV heads x 8 x 4 bytes = 256 B: 7 KiB a row) under a budget
  of 5 rows' cache decode 4 rows at a time, greedy tokens as one batch makes them."""
  from rollouts.jax_engine import cache_bytes_per_token
  assert cache_bytes_per_token(tiny_cfg) == 2 * 2 * 2 * 8 * 4
  prompts = [[1, 5 + i % 7, 9, 12 + i % 3][: 2 + i % 3] for i in range(20)]
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  whole = JaxEngine(tiny_cfg, tiny_params).generate(prompts, greedy, seed=0)
  row = 28 * cache_bytes_per_token(tiny_cfg)
  budgeted = JaxEngine(tiny_cfg, tiny_params, kv_cache_gib=5 * row / 2**30)
  assert budgeted._rows_per_batch(28) == 4
  for a, b in zip(whole, budgeted.generate(prompts, greedy, seed=0)):
    assert a.token_ids.tolist() == b.token_ids.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  with pytest.raises(ValueError, match="kv_cache_gib.*cannot hold one sequence of 28"):
    JaxEngine(tiny_cfg, tiny_params, kv_cache_gib=row / 2 / 2**30).generate(
        prompts, greedy, seed=0)


def test_an_engine_in_bf16_holds_and_scores_with_bf16_copies(tiny_cfg, tiny_params):
  """dtype='bfloat16': the engine reads bf16 copies of float32 weights (made at every update,
  so it does not keep the arrays it is given); its scores are the float32 model's within
  bf16's rounding."""
  engine = JaxEngine(tiny_cfg, tiny_params, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
  assert not engine.capabilities.keeps_weight_arrays
  moved = jax.tree.map(lambda x: x + 1, tiny_params)
  engine.update_weights(moved, version=1)
  assert {x.dtype for x in jax.tree.leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(tiny_params)} == {jnp.dtype(jnp.float32)}
  assert engine._hold._cache_size() == 1  # the copy compiled once, not at every update
  engine.update_weights(tiny_params, version=1)
  prompts, continuations = [[1, 5, 9], [1, 7]], [[3, 4, 5, 6], [8, 9]]
  want = JaxEngine(tiny_cfg, tiny_params).score(prompts, continuations)
  for got, expected in zip(engine.score(prompts, continuations), want):
    assert np.abs(got - expected).max() < 0.05
    assert not np.array_equal(got, expected)  # it did compute with other weights
  out = engine.generate([[1, 4]] * 3, SamplingParams(max_new_tokens=5), seed=0)
  assert [c.versions.tolist() for c in out] == [[1] * 5] * 3


def test_an_engine_on_a_mesh_holds_weights_split_over_tensor_and_splits_rows(tiny_cfg,
                                                                          tiny_params):
  """Weights placed for training on fsdp=2 x tensor=2 are held whole over fsdp (split over
  tensor only) and each fsdp replica decodes half the rows: greedy tokens as on one device.
  (The check that a replica fits a device's free memory needs a device that reports it.)"""
  from models import sharding
  mesh = sharding.make_mesh(fsdp=2, tensor=2)
  placed = jax.device_put(tiny_params, sharding.param_shardings(tiny_params, mesh))
  engine = JaxEngine(tiny_cfg, placed)
  q_proj = engine.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert "fsdp" not in str(q_proj.sharding.spec) and "tensor" in str(q_proj.sharding.spec)
  assert "fsdp" in str(placed["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec)
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23, 24, 25], [1, 3, 3]] * 2
  greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
  want = JaxEngine(tiny_cfg, tiny_params).generate(prompts, greedy, seed=0)
  for a, b in zip(want, engine.generate(prompts, greedy, seed=0)):
    assert a.token_ids.tolist() == b.token_ids.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  # layout='training': the trainer's arrays as they are (no copy).
  as_placed = JaxEngine(tiny_cfg, placed, layout="training")
  assert as_placed.params is placed and as_placed.capabilities.keeps_weight_arrays


def test_categorical_draws_each_token_with_its_probability():
  """Inverse transform sampling: frequencies over 200,000 draws within 4 standard errors of
  softmax(logits), tokens of logit -inf (a nucleus cut) never drawn, rows independent."""
  from rollouts.decoding import categorical
  probs = np.array([[0.5, 0.0, 0.3, 0.15, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                    [1 / 6] * 6])
  logits = jnp.log(jnp.asarray(probs, jnp.float32))  # log 0 = -inf
  draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, logits)))(
      jax.random.split(jax.random.PRNGKey(0), 200_000)))
  for row, p in enumerate(probs):
    freq = np.bincount(draws[:, row], minlength=6) / len(draws)
    assert np.all(np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / len(draws)) + 1e-9), (row, freq)
  assert abs(np.corrcoef(draws[:, 0], draws[:, 2])[0, 1]) < 0.01


def test_top_p_keeps_only_the_nucleus(tiny_cfg, tiny_params):
  # With a tiny top_p only the argmax survives: sampling equals greedy decoding.
  engine = JaxEngine(tiny_cfg, tiny_params)
  prompts = [[1, 5, 9], [1, 30]]
  greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), seed=0)
  nucleus = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0,
                                                    top_p=1e-6), seed=5)
  for g, n in zip(greedy, nucleus):
    assert g.token_ids.tolist() == n.token_ids.tolist()


def test_chunked_logprobs_equal_full_logits():
  key = jax.random.PRNGKey(1)
  hidden = jax.random.normal(key, (3, 7, 16))
  unembed = jax.random.normal(jax.random.PRNGKey(2), (16, 50))
  targets = jax.random.randint(jax.random.PRNGKey(3), (3, 7), 0, 50)
  logp, entropy = logprobs.token_logprobs(hidden, unembed, targets, chunk_size=4)
  full = jax.nn.log_softmax(hidden @ unembed)
  np.testing.assert_allclose(logp, jnp.take_along_axis(full, targets[..., None], -1)[..., 0],
                             atol=1e-5)
  np.testing.assert_allclose(entropy, -jnp.sum(jnp.exp(full) * full, -1), atol=1e-5)
  # Gradients through the checkpointed chunks equal those of the dense computation.
  dense = lambda h: jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(h @ unembed),
                                                targets[..., None], -1))
  chunked = lambda h: jnp.sum(logprobs.token_logprobs(h, unembed, targets, chunk_size=4)[0])
  np.testing.assert_allclose(jax.grad(chunked)(hidden), jax.grad(dense)(hidden), atol=1e-5)


def test_packed_rows_equal_separate_sequences(tiny_cfg, tiny_params):
  """Segment masking and restarting positions make a packed row compute each sequence alone."""
  a, b = [1, 5, 6, 7, 8], [1, 9, 10]
  packed = jnp.asarray([a + b + [0, 0]])
  pos = jnp.asarray([list(range(5)) + list(range(3)) + [0, 0]])
  seg = jnp.asarray([[1] * 5 + [2] * 3 + [0, 0]])
  hidden = transformer.forward(tiny_params, tiny_cfg, packed, pos, seg)
  for seq, start in ((a, 0), (b, 5)):
    alone = transformer.forward(tiny_params, tiny_cfg, jnp.asarray([seq]),
                                jnp.arange(len(seq))[None], jnp.ones((1, len(seq)), jnp.int32))
    np.testing.assert_allclose(hidden[0, start:start + len(seq)], alone[0], atol=1e-5)


def test_attention_mask_shapes():
  mask = reference.segment_causal_mask(jnp.asarray([[1, 1, 2, 0]]))
  expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask[0], expected)


def test_model_config_rejects_bad_heads():
  from models.config import ModelConfig
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(vocab_size=10, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=3,
                head_dim=8, intermediate_size=64)


def _saved_activations(fn, *args):
  """How many [rows, seq, ...] or [rows * seq, ...] (projections run on tokens) float arrays
  the backward pass of `fn` keeps from the forward."""
  import contextlib
  import io
  from jax.ad_checkpoint import print_saved_residuals
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(fn, *args)
  return sum(line.startswith(("f32[4,512,", "f32[2048,")) for line in out.getvalue().splitlines())


@pytest.mark.parametrize("scaling", [None, config.Llama3Rope(8.0, 1.0, 4.0, 8192)])
def test_rope_tables_rotate_by_position_times_frequency(scaling):
  """RoPE from its cos/sin tables: below position 1024 as Hugging Face computes it (float32
  angle, float32 cos and sin); up to 2^20 within float32 angle rounding of the exact
  rotation; beyond, NaN."""
  head_dim, theta = 64, 500000.0
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 3, head_dim))
  tables = rope.rope_tables(head_dim, theta, scaling)
  inv_freq = rope.rope_frequencies(head_dim, theta, scaling)

  def direct(positions, dtype):  # the textbook rotation, in `dtype`
    angles = positions[..., None].astype(dtype) * inv_freq.astype(dtype)
    angles = np.concatenate([angles, angles], -1)[:, :, None, :]
    x64 = np.asarray(x, dtype)
    rotated = np.concatenate([-x64[..., head_dim // 2:], x64[..., :head_dim // 2]], -1)
    return x64 * np.cos(angles) + rotated * np.sin(angles)

  small = np.array([[0, 1, 2, 511, 1022, 1023], [7, 100, 1000, 3, 900, 64]], np.int32)
  got = np.asarray(rope.rope(x, jnp.asarray(small), tables))
  np.testing.assert_allclose(got, direct(small, np.float32), atol=2e-6)
  large = np.array([[1024, 1025, 4097, 32768, 100000, 2**20 - 1],
                    [131071, 65536, 2047, 999999, 524288, 12345]], np.int32)
  got = np.asarray(rope.rope(x, jnp.asarray(large), tables))
  # float32 fine angles (< 1024 rad) are off by up to half an ulp, 3e-5 rad.
  np.testing.assert_allclose(got, direct(large, np.float64), atol=2e-4)
  beyond = np.asarray(rope.rope(x, jnp.full((2, 6), 2**20, jnp.int32), tables))
  assert np.isnan(beyond).all()


def test_swiglu_gradients_equal_autodiff_and_keep_only_its_inputs():
  gate = jax.random.normal(jax.random.PRNGKey(0), (2048, 48)) * 6  # well into both tails
  up = jax.random.normal(jax.random.PRNGKey(1), (2048, 48))
  d_out = jax.random.normal(jax.random.PRNGKey(2), (2048, 48))
  plain = lambda g, u: jnp.sum(jax.nn.silu(g) * u * d_out)
  ours = lambda g, u: jnp.sum(layers.swiglu(g, u) * d_out)
  np.testing.assert_allclose(ours(gate, up), plain(gate, up), rtol=1e-6)
  for got, want in zip(jax.grad(ours, (0, 1))(gate, up), jax.grad(plain, (0, 1))(gate, up)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The plain form keeps sigmoid or silu outputs besides its inputs; ours keeps the inputs only.
  saved = lambda fn: _saved_activations(lambda g, u: jnp.sum(fn(g, u)), gate, up)
  assert saved(layers.swiglu) == 2 < saved(lambda g, u: jax.nn.silu(g) * u)


def test_remat_policies_keep_gradients_and_lower_compiled_memory():
  """Per-layer rematerialisation changes what the backward pass stores, not what it computes;
  and it lowers the compiled gradient's temporaries on XLA:CPU (over unrolled layers it did
  not: the recomputation merged back into the forward pass)."""
  import dataclasses
  from models import config

  # Short rows: at 512 tokens the attention's own temporaries outweigh the layers' activations.
  base = config.tiny(64, hidden_size=64, num_layers=4, intermediate_size=256)
  params = transformer.init_params(base, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 128), 3, 64)
  positions = jnp.broadcast_to(jnp.arange(128), (16, 128))
  seg = jnp.ones((16, 128), jnp.int32)
  temp, grads = {}, {}
  for policy in ("none", "full", "dots"):
    cfg = dataclasses.replace(base, remat=policy)
    loss = lambda p: jnp.sum(jnp.sin(transformer.forward(p, cfg, tokens, positions, seg)))
    grad = jax.jit(jax.grad(loss)).lower(params).compile()
    temp[policy] = grad.memory_analysis().temp_size_in_bytes
    grads[policy] = grad(params)
  assert temp["full"] < temp["dots"] < temp["none"], temp
  # Each layer keeps its input, [16, 128, 64] f32 (0.5 MiB), instead of ~20 arrays that size
  # (compiled here: 25 against 59 MiB).
  assert temp["full"] < temp["none"] / 2, temp
  for policy in ("full", "dots"):
    for w, g in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy])):
      np.testing.assert_allclose(g, w, atol=1e-5 * (np.abs(w).max() or 1.0), rtol=0)
