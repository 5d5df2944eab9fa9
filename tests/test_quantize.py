"""models/quantize.py: FP8 block and INT4 group quantization in SGLang's layouts, their exact
dequantization formulas, the INT4 packing of compressed-tensors, and straight-through fake
quantization; quantized checkpoints written and read by models/hf.py; an engine on quantized
weights, and quantization-aware training (ModelConfig.weight_format)."""

import dataclasses
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config, hf, projections, quantize, transformer
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rollouts import jax_engine
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from rollouts.server.main import launch
from rollouts.sglang import SGLangClient, ServerError
from rollouts.sglang_engine import SGLangEngine, Unservable, local_engine, remote_engine


def _weight(out, inp, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (out, inp)) * 0.05


def test_fp8_blocks_scale_each_128_block_by_its_largest_value_and_round_within_e4m3():
  w = _weight(200, 300)  # edge blocks: 72 rows, 44 columns
  q, scale = quantize.fp8_quantize(w)
  assert q.dtype == jnp.float8_e4m3fn and q.shape == (200, 300)
  assert scale.dtype == jnp.float32 and scale.shape == (2, 3)
  for i, j in ((0, 0), (1, 2)):
    block = np.abs(np.asarray(w)[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)])
    assert float(scale[i, j]) == pytest.approx(block.max() / 448.0, rel=1e-6)
  back = np.asarray(quantize.fp8_dequantize(q, scale))
  # The dequantization is w = q * s blockwise, exactly.
  expect = np.asarray(q, np.float32) * np.repeat(np.repeat(np.asarray(scale), 128, 0), 128,
                                                    1)[:200, :300]
  np.testing.assert_array_equal(back, expect)
  # e4m3 keeps 3 mantissa bits: within 2^-4 relative, or half its smallest step near 0.
  per_element = expect / np.where(np.asarray(q, np.float32) == 0, 1, np.asarray(q, np.float32))
  err = np.abs(back - np.asarray(w))
  bound = np.maximum(2.0 ** -4 * np.abs(np.asarray(w)), 2.0 ** -10 * np.abs(per_element))
  assert np.all(err <= bound + 1e-12)
  # Each block's largest value comes back exactly (it is 448 * s).
  assert np.abs(back).max() == pytest.approx(np.abs(np.asarray(w)).max(), rel=1e-6)


def test_int4_packing_is_compressed_tensors_order():
  """formats.md 3.4: pack_to_int32 of [-8, -7, 0, 1, 2, 3, 4, 7] is 0xFCBA9810."""
  q = jnp.asarray([[-8, -7, 0, 1, 2, 3, 4, 7]], jnp.int32)
  packed = quantize.pack_int4(q)
  assert packed.dtype == jnp.int32
  assert int(np.asarray(packed).view(np.uint32)[0, 0]) == 0xFCBA9810
  every = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (5, 64)), jnp.int32)
  np.testing.assert_array_equal(quantize.unpack_int4(quantize.pack_int4(every)), every)


def test_int4_groups_round_to_the_nearest_level_of_their_stored_scale():
  w = _weight(48, 96)
  assert quantize.int4_quantize(w)[1].dtype == jnp.float32  # the weights' dtype by default
  packed, scale = quantize.int4_quantize(w, group=32, scale_dtype=jnp.bfloat16)
  assert packed.shape == (48, 12) and scale.shape == (48, 3) and scale.dtype == jnp.bfloat16
  per_element = np.repeat(np.asarray(scale, np.float32), 32, axis=1)
  np.testing.assert_allclose(np.asarray(scale, np.float32),
                             np.abs(np.asarray(w)).reshape(48, 3, 32).max(-1) / 7.5,
                             rtol=2 ** -8)  # bf16
  back = np.asarray(quantize.int4_dequantize(packed, scale, group=32))
  q = np.asarray(quantize.unpack_int4(packed))
  assert q.min() >= -8 and q.max() <= 7
  np.testing.assert_array_equal(back, q * per_element)  # w = q * scale, exactly
  # Nearest level: within half a step, but for the largest |w| of a group, 7.5 steps of the
  # exact scale and so up to 7.5 x 2^-8 of a step more of the bf16-rounded one, which a clamp
  # at +7 may round away from.
  err = np.abs(back - np.asarray(w))
  assert np.all(err <= (0.5 + 7.5 * 2 ** -8) * per_element + 1e-9)
  assert np.mean(err <= 0.5 * per_element * (1 + 1e-6)) > 0.95
  with pytest.raises(ValueError, match="multiple of the group size 32"):
    quantize.int4_quantize(_weight(4, 40))


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_fake_quantization_rounds_forward_and_passes_gradients_straight_through(fmt):
  w = _weight(64, 128)
  quantize_fn, dequantize_fn = quantize.FORMATS[fmt]
  np.testing.assert_array_equal(quantize.fake_quantize(w, fmt),
                                dequantize_fn(*quantize_fn(w), dtype=w.dtype))
  cotangent = jax.random.normal(jax.random.PRNGKey(1), w.shape)
  grad = jax.grad(lambda w: jnp.sum(quantize.fake_quantize(w, fmt) * cotangent))(w)
  np.testing.assert_array_equal(grad, cotangent)
  with pytest.raises(ValueError, match="unknown weight format 'int3'"):
    quantize.fake_quantize(w, "int3")


SMALL_QWEN = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64,
              "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}


def _header(path):
  with open(path, "rb") as f:
    (length,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(length))


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_quantized_export_is_sglangs_layout_and_loads_back_dequantized(fmt, tmp_path):
  cfg = hf.config_from_hf(SMALL_QWEN)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  out = hf.save(params, cfg, str(tmp_path / fmt), quantization=fmt)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["quantization_config"] == hf.QUANTIZATIONS[fmt]
  header = _header(os.path.join(out, hf.SINGLE))
  up = "model.layers.1.mlp.up_proj"  # HF weight [160, 64]
  if fmt == "fp8":
    assert header[f"{up}.weight"]["dtype"] == "F8_E4M3"
    assert header[f"{up}.weight_scale_inv"] == {**header[f"{up}.weight_scale_inv"],
                                                "dtype": "F32", "shape": [2, 1]}
  else:
    assert f"{up}.weight" not in header
    assert (header[f"{up}.weight_packed"]["dtype"], header[f"{up}.weight_packed"]["shape"]) == (
        "I32", [160, 8])
    assert header[f"{up}.weight_scale"]["shape"] == [160, 2]
    assert header[f"{up}.weight_shape"]["dtype"] == "I64"
  for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
    assert header[kept]["dtype"] == "F32"
  _, loaded = hf.load(out)
  quantize_fn, dequantize_fn = quantize.FORMATS[fmt]
  if fmt == "int4":  # its scales are stored in the checkpoint's dtype, float32 here
    quantize_fn = lambda w: quantize.int4_quantize(w, scale_dtype=jnp.float32)
  for path in (("layers_1", "mlp", "up_proj", "kernel"), ("layers_0", "mlp", "down_proj",
                                                          "kernel")):
    kernel = params[path[0]][path[1]][path[2]][path[3]]
    want = dequantize_fn(*quantize_fn(kernel.T)).T  # what the engine computes with
    got = loaded[path[0]][path[1]][path[2]][path[3]]
    np.testing.assert_array_equal(got, want)
    assert 0 < np.abs(got - kernel).max() <= (0.1 if fmt == "fp8" else 0.6) * np.abs(kernel).max()
  np.testing.assert_array_equal(loaded["embed_tokens"]["embedding"],
                                params["embed_tokens"]["embedding"])
  # The attention projections, split by head in our layout, round-trip the same way.
  q = params["layers_0"]["self_attn"]["q_proj"]["kernel"]  # [hidden, heads, head_dim]
  want = dequantize_fn(*quantize_fn(q.reshape(64, 64).T)).T.reshape(q.shape)
  np.testing.assert_array_equal(loaded["layers_0"]["self_attn"]["q_proj"]["kernel"], want)
  # Kept as stored (a server's weights at rest): the checkpoint's own tensors, which the model
  # dequantizes to exactly the kernels above.
  _, held = hf.load(out, packed=True)
  up_held = held["layers_1"]["mlp"]["up_proj"]["kernel"]
  assert isinstance(up_held, quantize.Packed) and up_held.fmt == fmt
  stored = [hf._read(os.path.join(out, hf.SINGLE), f"{up}.{name}") for name in (
      ("weight", "weight_scale_inv") if fmt == "fp8" else ("weight_packed", "weight_scale"))]
  for a, b in zip(up_held.stored, stored):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  jax.tree.map(np.testing.assert_array_equal, projections.unpack_projections(held), loaded)
  with pytest.raises(ValueError, match="unknown quantization 'int3'"):
    hf.save(params, cfg, str(tmp_path / "bad"), quantization="int3")


def test_an_unknown_quantization_config_is_refused_by_name(tmp_path):
  cfg = hf.config_from_hf(SMALL_QWEN)
  out = hf.save(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "m"),
                quantization="fp8")
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  config["quantization_config"]["weight_block_size"] = [64, 64]
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(hf.CheckpointError, match="not one longrl reads"):
    hf.load(out)


def _rounded(params, fmt):
  """params with every decoder projection's kernel rounded to `fmt` explicitly."""
  def one(path, x):
    names = [getattr(k, "key", "") for k in path]
    if names[-1] != "kernel" or not names[-2].endswith("_proj"):
      return x
    inputs = 2 if names[-2] == "o_proj" else 1  # o_proj's kernel is [heads, head_dim, hidden]
    matrix = x.reshape(int(np.prod(x.shape[:inputs])), -1).T
    return quantize.fake_quantize(matrix, fmt).T.reshape(x.shape)
  return jax.tree_util.tree_map_with_path(one, params)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_an_engine_holds_its_weights_quantized_and_computes_on_them(fmt):
  cfg = config.tiny(64, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23]]
  sampling = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(2,))
  engine = jax_engine.embedded_engine(cfg, params, 0, weight_format=fmt)
  down = engine.params["layers_0"]["mlp"]["down_proj"]["kernel"]
  assert isinstance(down, quantize.Packed) and down.shape == (128, 64)
  full = sum(x.nbytes for x in jax.tree.leaves(params))
  projected = 2 * (3 * 64 * 128 + 64 * 64 + 2 * 64 * 32 + 64 * 64) * 4  # f32 bytes
  packed = projected // 4 if fmt == "fp8" else projected // 8 + projected // 32
  scales = 2 * 7 * 4 if fmt == "fp8" else 0  # one f32 per 128 x 128 block, 7 kernels a layer
  assert engine.weight_bytes == full - projected + packed + scales
  on_format = engine.generate(prompts, sampling, seed=3)
  on_rounded = JaxEngine(cfg, _rounded(params, fmt)).generate(prompts, sampling, seed=3)
  for a, b in zip(on_format, on_rounded):
    assert a.token_ids.tolist() == b.token_ids.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
  engine.update_weights(transformer.init_params(cfg, jax.random.PRNGKey(1)), 1)
  assert engine.params["layers_0"]["mlp"]["down_proj"]["kernel"].fmt == fmt


def test_quantization_aware_training_computes_what_the_int4_engine_does():
  cfg = config.tiny(64, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  prompts = [[1, 5, 9, 12], [1, 7], [1, 20, 21, 22, 23]]
  sampling = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(2,))
  on_int4 = jax_engine.embedded_engine(cfg, params, 0, weight_format="int4").generate(
      prompts, sampling, seed=3)
  batch, _ = trajectory_batch(prompts, [c.token_ids for c in on_int4],
                              [c.logprobs for c in on_int4], [0.0] * 3, [True] * 3, seq_len=32)
  mask = batch.loss_mask > 0
  gap = lambda model: np.abs(np.asarray(policy_logprobs(
      params, model, jax.tree.map(jnp.asarray, batch))[0]) - batch.old_logp)[mask].max()
  # Quantization-aware: the trainer's model rounds the same weights the same way.
  assert gap(dataclasses.replace(cfg, weight_format="int4")) <= 1e-4
  assert gap(cfg) > 1e-3  # without it, the trainer sees another function
  with pytest.raises(ValueError, match="weight_format='int3'"):
    dataclasses.replace(cfg, weight_format="int3")


def test_our_server_serves_and_is_refit_with_fp8_exports(tmp_path):
  """The production path on CPU: servers (rollouts/server/) started from an FP8 export and
  refit with FP8 exports compute what the embedded FP8 engine does (SGLang keeps FP8's
  parameters through a reload: docs/sglang.md 3(m))."""
  cfg = config.tiny(64, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
  params = [transformer.init_params(cfg, jax.random.PRNGKey(seed)) for seed in (0, 1)]
  prompts = [[3, 17, 22, 9], [40, 41], [5] * 9]
  greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
  engine = local_engine(cfg, params[0], 0, weights_dir=str(tmp_path), export_dtype="float32",
                        weight_format="fp8")
  try:
    with open(os.path.join(engine.weights_path, "config.json")) as f:
      assert json.load(f)["quantization_config"] == hf.QUANTIZATIONS["fp8"]
    for version, p in enumerate(params):
      if version:
        engine.update_weights(p, version)
      served = engine.generate(prompts, greedy, seed=0)
      local = jax_engine.embedded_engine(cfg, p, version, weight_format="fp8").generate(
          prompts, greedy, seed=0)
      for a, b in zip(served, local):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert set(a.versions.tolist()) == {version}
  finally:
    engine.close()


def test_int4_is_served_from_the_start_and_a_refit_takes_the_server_down_as_sglangs(
    tmp_path):
  """SGLang 0.5.23 serves an INT4 (compressed-tensors) checkpoint but goes down at its first
  refit from disk (rollouts/sglang_engine.py refusals has the lines): our server computes what the
  embedded INT4 engine does and goes down at that refit too; local_engine and remote_engine
  refuse INT4 before they start or ask anything."""
  cfg = config.tiny(64, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
  params = [transformer.init_params(cfg, jax.random.PRNGKey(seed)) for seed in (0, 1)]
  prompts = [[3, 17, 22, 9], [40, 41], [5] * 9]
  greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
  paths = [hf.save(p, cfg, str(tmp_path / f"v{i}"), quantization="int4")
           for i, p in enumerate(params)]
  with open(os.path.join(paths[0], "config.json")) as f:
    assert json.load(f)["quantization_config"] == hf.QUANTIZATIONS["int4"]
  process, url = launch(["--hf_checkpoint", paths[0], "--weight_version", "0", "--dtype",
                         "float32"])
  client = SGLangClient([url], retries=0, retry_backoff=0.1)
  try:
    engine = SGLangEngine(client, cfg, weights_dir=str(tmp_path), weights_path=paths[0])
    served = engine.generate(prompts, greedy, seed=0)
    local = jax_engine.embedded_engine(cfg, params[0], 0, weight_format="int4").generate(
        prompts, greedy, seed=0)
    for a, b in zip(served, local):
      assert a.token_ids.tolist() == b.token_ids.tolist()
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    with pytest.raises(ServerError):
      client.sync_weights(paths[1], 1)
    assert process.wait(timeout=60) != 0  # gone, as SGLang's scheduler exits
  finally:
    client.close()
    process.kill()
    process.wait()
  for factory, where in ((local_engine, {}), (remote_engine, {"urls": ["http://127.0.0.1:1"],
                                                             "weights_dir": str(tmp_path)})):
    with pytest.raises(Unservable, match=r"compressed_tensors_wNa16\.py L234-245"):
      factory(cfg, params[0], 0, weight_format="int4", **where)