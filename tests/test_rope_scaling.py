"""RoPE scalings (linear, dynamic, yarn) against transformers: tiny Qwen2 and Qwen3 checkpoints
whose config.json names each scaling give transformers' logits at positions past their
original context; our KV-cache decoding past it agrees with the uncached forward (and, for
YaRN, with transformers' generate); exports load back into transformers unchanged."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra pins the CPU wheel
import transformers

from models import config, hf, rope, transformer
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

VOCAB = 96
ORIGINAL = 32  # the checkpoints' original (pretraining) context
SEQ = 96  # three times past it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
# rope parameters and the config.json fields each scaling reads besides them
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    # transformers scales dynamic NTK by the sequence's length; ours is fixed at
    # factor x max_position_embeddings (models/config.py, DynamicRope): SEQ tokens here.
    "dynamic": ({"rope_type": "dynamic", "factor": SEQ / ORIGINAL},
                {"max_position_embeddings": ORIGINAL}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
             {"max_position_embeddings": 4 * ORIGINAL}),
    # every optional YaRN parameter away from its default, temperature in DeepSeek's spelling
    "yarn_options": ({"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0,
                      "beta_slow": 2.0, "truncate": False, "mscale": 0.8,
                      "mscale_all_dim": 1.0}, {"max_position_embeddings": 4 * ORIGINAL}),
}
FAMILIES = {"qwen2": lambda **kw: transformers.Qwen2Config(tie_word_embeddings=True, **kw),
            "qwen3": lambda **kw: transformers.Qwen3Config(head_dim=24, **kw)}
CHECKPOINTS = [("qwen2", "linear"), ("qwen2", "dynamic"), ("qwen2", "yarn"),
               ("qwen3", "linear"), ("qwen3", "dynamic"), ("qwen3", "yarn"),
               ("qwen3", "yarn_options")]


def _hf_config(family, scaling):
  parameters, fields = SCALINGS[scaling]
  return FAMILIES[family](rope_parameters={"rope_theta": 10000.0, **parameters}, **fields,
                          **COMMON)


def _write_checkpoint(family, scaling, path):
  """(transformers' model, our cfg, our params) of a random checkpoint written to `path`."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, scaling)).eval()
  with torch.no_grad():  # norms and biases random too, so a mix-up cannot hide
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.15)
      if name.endswith("norm.weight"):  # RMSNorm scales near 1, as trained models have them:
        p.add_(1.0)  # attention then depends on position enough to show in the logits
  model.save_pretrained(path)
  return (model, *hf.load(path))


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=["-".join(c) for c in CHECKPOINTS])
def checkpoint(request, tmp_path_factory):
  family, scaling = request.param
  path = str(tmp_path_factory.mktemp(f"{family}_{scaling}"))
  return (scaling, *_write_checkpoint(family, scaling, path))


def _hf_logits(model, tokens):
  """transformers' logits for whole unpadded rows (so dynamic NTK sees SEQ tokens)."""
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _our_logits(params, cfg, tokens):
  rows, seq = tokens.shape
  hidden = transformer.forward(params, cfg, jnp.asarray(tokens),
                               jnp.asarray(np.arange(seq)[None].repeat(rows, 0)),
                               jnp.ones((rows, seq), jnp.int32))
  return np.asarray(hidden @ transformer.output_projection(params, cfg))


def test_config_reads_the_scaling(checkpoint):
  scaling, _, cfg, _ = checkpoint
  expected = {
      "linear": config.LinearRope(4.0),
      "dynamic": config.DynamicRope(3.0, ORIGINAL),
      "yarn": config.YarnRope(4.0, ORIGINAL),
      "yarn_options": config.YarnRope(4.0, ORIGINAL, beta_fast=8.0, beta_slow=2.0,
                                      truncate=False, mscale_all_dim=1.0),
  }[scaling]
  assert dataclasses.replace(cfg.rope_scaling, attention_factor=None) == expected if (
      scaling == "yarn_options") else cfg.rope_scaling == expected
  if scaling == "yarn_options":  # mscale / mscale_all_dim: (0.08 ln 4 + 1) / (0.1 ln 4 + 1)
    assert cfg.rope_scaling.attention_factor == pytest.approx(
        (0.08 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1), rel=1e-12)


def test_logits_equal_transformers_past_the_original_context(checkpoint):
  scaling, model, cfg, params = checkpoint
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
  want = _hf_logits(model, tokens)
  got = _our_logits(params, cfg, tokens)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  # The scaling matters past the original context: plain RoPE is far off there.
  plain = _our_logits(params, dataclasses.replace(cfg, rope_scaling=None), tokens)
  assert np.abs(plain - want)[:, ORIGINAL:].max() > 100 * np.abs(got - want).max()


def test_yarn_attention_factor_scales_every_position_once():
  """The factor rides on the fine tables only, so positions past ROPE_FINE (where a coarse
  entry multiplies in) are scaled once too: rope = the rotation by position x frequency,
  times the factor."""
  head_dim, theta, scaling = 64, 1e6, config.YarnRope(4.0, 32768)
  tables = rope.rope_tables(head_dim, theta, scaling)
  inv_freq = rope.rope_frequencies(head_dim, theta, scaling).astype(np.float64)
  positions = np.array([[0, 1, 1023, 1024, 1025, 5000, 32768, 131071]], np.int32)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, positions.shape[1], 2, head_dim)))
  angles = np.concatenate([positions[..., None] * inv_freq] * 2, -1)[:, :, None, :]
  rotated = np.concatenate([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)
  want = rope.rope_attention_factor(scaling) * (x * np.cos(angles) +
                                                       rotated * np.sin(angles))
  got = np.asarray(rope.rope(jnp.asarray(x), jnp.asarray(positions), tables))
  np.testing.assert_allclose(got, want, atol=2e-4)  # float32 angles, as test_model's test


@pytest.mark.parametrize("scaling", ["yarn", "dynamic"])
def test_cached_decoding_past_the_original_context_equals_the_forward(scaling, tmp_path):
  """Greedy decoding with the KV cache from a 20-token prompt to position 90: each token is the
  argmax of the uncached forward over the whole sequence, with its log-prob. Under YaRN the
  tokens are also transformers' greedy ones (its cache holds the same rotations; its dynamic
  NTK re-scales at every step, so there it has no fixed answer to compare)."""
  model, cfg, params = _write_checkpoint("qwen3", scaling, str(tmp_path))
  prompts = [list(np.random.default_rng(2).integers(0, VOCAB, 20)), [7, 8, 9]]
  new = 70
  completions = JaxEngine(cfg, params).generate(
      prompts, SamplingParams(max_new_tokens=new, temperature=0.0), seed=0)
  for prompt, completion in zip(prompts, completions):
    assert len(completion.token_ids) == new
    sequence = np.array(prompt + list(completion.token_ids))[None]
    logits = _our_logits(params, cfg, sequence)[0, len(prompt) - 1:-1]
    np.testing.assert_array_equal(completion.token_ids, logits.argmax(-1))
    logp = np.asarray(jax.nn.log_softmax(logits))[np.arange(new), completion.token_ids]
    np.testing.assert_allclose(completion.logprobs, logp, atol=1e-4)
    if scaling == "yarn":
      with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
      assert list(completion.token_ids) == out[0, len(prompt):].tolist()


def test_export_loads_back_into_transformers_unchanged(checkpoint, tmp_path):
  scaling, model, cfg, params = checkpoint
  out = hf.save(params, cfg, str(tmp_path / "export"))
  assert hf.load(out)[0] == cfg
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.random.default_rng(3).integers(0, VOCAB, (1, SEQ))
  np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(model, tokens),
                             atol=1e-6, rtol=0)


def test_rope_scaling_as_qwen_model_cards_spell_it():
  """Qwen2.5's cards say to add {"type": "yarn", ...} as rope_scaling to config.json; it
  replaces rope_parameters whole (transformers 5 does the same), rope_theta from the top."""
  hf_config = _hf_config("qwen2", "linear").to_dict()
  hf_config.update(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32768})
  cfg = hf.config_from_hf(hf_config)
  assert cfg.rope_scaling == config.YarnRope(4.0, 32768) and cfg.rope_theta == 1e6
  theirs = transformers.Qwen2Config.from_dict(hf_config).rope_parameters
  assert (theirs["rope_type"], theirs["rope_theta"]) == ("yarn", 1e6)


def test_bad_rope_parameters_fail_clearly(tmp_path):
  hf_config = _hf_config("qwen2", "linear").to_dict()
  hf_config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(hf.CheckpointError, match="'longrope' is not supported.*yarn"):
    hf.load(str(tmp_path))
  hf_config["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0}
  with pytest.raises(hf.CheckpointError, match="'linear' needs factor"):
    hf.config_from_hf(hf_config)
