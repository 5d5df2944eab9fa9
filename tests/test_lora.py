"""LoRA (models/lora.py, RLConfig.lora): an adapted forward pass equals the merged weights'
in every family's projections (dense, a mixture's experts, latent attention) and in both layer
paths, and so do its gradients; a fresh adapter leaves the base as it is; a quantized base
(QLoRA) and quantization-aware training take adapters; a LoRA run moves only its adapters over
a frozen base that is also its reference, checkpoints the adapters alone, resumes exactly, and
gives the engine the merged weights."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from models import config, hf, hf_lora, lora, projections, transformer
from models.config import MlaConfig, ModelConfig, MoeConfig
from models.lora import LoraConfig
from rl import ConfigError, checkpoint, trainer
from rl import hooks as hooks_lib
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from tests.test_hf import _write_checkpoint

MOE = MoeConfig(num_experts=4, experts_per_token=2, expert_size=24, shared_size=16)
LATENT = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                     head_dim=12, intermediate_size=48, family="deepseek_v3",
                     moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=16,
                                   dense_layers=(0,), scoring="sigmoid", correction_bias=True,
                                   shared_size=16),
                     mla=MlaConfig(kv_rank=8, rope_dim=4, value_dim=8, q_rank=12))
FAMILIES = {"qwen2 (q/k/v biases)": config.tiny(64, hidden_size=32, intermediate_size=48),
            "qwen3_moe (routed and shared experts)": config.tiny(64, hidden_size=32,
                                                                 intermediate_size=48, moe=MOE),
            "deepseek_v3 (latent attention)": LATENT}


def _rows(cfg, rows=2, seq=10):
  tokens = jax.random.randint(jax.random.PRNGKey(3), (rows, seq), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
  segments = jnp.concatenate([jnp.ones((rows, seq - 3), jnp.int32),
                              jnp.full((rows, 3), 2, jnp.int32)], axis=1)  # two packed segments
  return tokens, positions, segments


def _moved(adapters, key=2, size=0.05):
  """`adapters` with b (and a) moved off their start, as training would."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(key), len(leaves))
  return jax.tree.unflatten(tree, [x + size * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg, rows):
  hidden = transformer.forward(params, cfg, *rows)
  return hidden @ transformer.output_projection(lora.base_of(params), cfg)


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_adapted_forward_equals_the_merged_weights_and_differentiates_alike(family, remat):
  """The adapter's low-rank product beside the base's (dense projections) and the experts
  merged inside their layer give the logits of W + alpha / r A B, unrolled and in the layer
  scan; the adapters' gradients through either form agree; a fresh adapter (B = 0) changes
  nothing, bit for bit."""
  cfg = dataclasses.replace(FAMILIES[family], remat=remat)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  fresh = lora.init_adapters(params, LoraConfig(rank=4, alpha=8.0), cfg, jax.random.PRNGKey(1))
  rows = _rows(cfg)
  np.testing.assert_array_equal(_logits(lora.attach(params, fresh), cfg, rows),
                                _logits(params, cfg, rows))
  adapters = _moved(fresh)
  adapted = _logits(lora.attach(params, adapters), cfg, rows)
  merged = _logits(lora.merge(lora.attach(params, adapters)), cfg, rows)
  base = _logits(params, cfg, rows)
  assert float(jnp.max(jnp.abs(adapted - base))) > 0.05  # the adapters matter here
  np.testing.assert_allclose(adapted, merged, atol=2e-5, rtol=1e-5)

  def loss(adapters, merge):
    attached = lora.attach(params, adapters)
    logp = jax.nn.log_softmax(_logits(lora.merge(attached) if merge else attached, cfg, rows))
    return -jnp.mean(logp[..., 7])

  unmerged, through_merge = (jax.jit(jax.grad(loss), static_argnums=1)(adapters, m)
                             for m in (False, True))
  for g, h in zip(jax.tree.leaves(unmerged), jax.tree.leaves(through_merge)):
    np.testing.assert_allclose(g, h, atol=1e-6, rtol=2e-4)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(unmerged))


def test_targets_ranks_and_scales_follow_the_config():
  """Every projection by default (the MLP's, the shared and routed experts' included), only
  the named ones otherwise; a routed expert's rank is rank // num_experts (at least 1), its
  scale alpha over that rank."""
  cfg = config.tiny(64, hidden_size=32, intermediate_size=48, moe=MOE)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  adapters = lora.init_adapters(params, LoraConfig(rank=8, alpha=16.0), cfg,
                                jax.random.PRNGKey(1))
  layer = adapters["layers_0"]
  assert set(layer["self_attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
  assert set(layer["mlp"]) == {"experts_gate_proj", "experts_up_proj", "experts_down_proj",
                               "shared_experts"}
  assert set(layer["mlp"]["shared_experts"]) == {"gate_proj", "up_proj", "down_proj"}
  q, expert = layer["self_attn"]["q_proj"]["kernel"], layer["mlp"]["experts_up_proj"]
  assert (q.a.shape, q.b.shape, q.scale) == ((32, 8), (8, 4, 8), 2.0)
  o = layer["self_attn"]["o_proj"]["kernel"]  # [heads, head_dim, hidden]: two input dims
  assert (o.a.shape, o.b.shape) == ((4, 8, 8), (8, 32))
  assert (expert.a.shape, expert.b.shape, expert.scale) == ((4, 32, 2), (4, 2, 24), 8.0)
  assert np.all(np.asarray(q.b) == 0) and 0 < float(jnp.max(jnp.abs(q.a))) <= 32 ** -0.5
  only = lora.init_adapters(params, LoraConfig(rank=8, targets=("q_proj", "v_proj")), cfg,
                            jax.random.PRNGKey(1))
  assert set(only["layers_0"]) == {"self_attn"}
  assert LoraConfig(targets=("q_proj", "v_proj")).attention_only
  assert not LoraConfig().attention_only and not LoraConfig(targets=("down_proj",)).attention_only
  assert set(only["layers_0"]["self_attn"]) == {"q_proj", "v_proj"}
  assert lora.count(only) == 2 * (32 * 8 + 8 * 4 * 8 + 32 * 8 + 8 * 2 * 8)  # 2 kv heads


def test_bad_configs_name_what_is_wrong():
  dense = config.tiny(64, hidden_size=32, intermediate_size=48)
  params = transformer.init_params(dense, jax.random.PRNGKey(0))
  key = jax.random.PRNGKey(1)
  with pytest.raises(ValueError, match="LoraConfig.rank: 0"):
    lora.init_adapters(params, LoraConfig(rank=0), dense, key)
  with pytest.raises(ValueError, match=r"LoraConfig.targets: \['qkv'\] are not projections"):
    lora.init_adapters(params, LoraConfig(targets=("q_proj", "qkv")), dense, key)
  with pytest.raises(ValueError, match=r"no kernel among the targets \('kv_b_proj',\)"):
    lora.init_adapters(params, LoraConfig(targets=("kv_b_proj",)), dense, jax.random.PRNGKey(1))
  with pytest.raises(ConfigError, match=r"RLConfig.lora: LoRA: the model has no kernel"):
    trainer.build("/nonexistent/never-written", task=Arithmetic(digits=1, num_train=50,
                                                                 num_test=8),
                  model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=48),
                  rl=RLConfig(lora=LoraConfig(targets=("kv_b_proj",))))
  assert not os.path.exists("/nonexistent/never-written")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_quantized_base_takes_adapters(fmt):
  """QLoRA: the base held packed (the engine's and the export's layout), the adapter in
  float32 beside it: the dequantized base plus the adapter's product; and quantization-aware
  training rounds the base alone, not the adapter."""
  cfg = config.tiny(64, hidden_size=64, intermediate_size=64)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  adapters = _moved(lora.init_adapters(params, LoraConfig(rank=4), cfg, jax.random.PRNGKey(1)))
  rows = _rows(cfg)
  packed = projections.pack_projections(params, fmt)
  dequantized = projections.unpack_projections(packed)
  np.testing.assert_allclose(
      _logits(lora.attach(packed, adapters), cfg, rows),
      _logits(lora.merge(lora.attach(dequantized, adapters)), cfg, rows), atol=2e-5, rtol=1e-5)
  rounded = dataclasses.replace(cfg, weight_format=fmt)
  np.testing.assert_allclose(
      _logits(lora.attach(params, adapters), rounded, rows),
      _logits(lora.attach(dequantized, adapters), cfg, rows), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen2_moe", "deepseek_v3"])
def test_a_peft_export_loads_in_peft_over_transformers_with_our_logits(family, tmp_path):
  """save_adapter writes a PEFT directory that peft 0.22 loads over the transformers model
  (q/k/v/o and the MLP; a mixture's routed and shared experts, which peft fuses for
  transformers 5; latent attention's four projections) to logits equal to ours with the
  adapters attached; load_adapter reads it back to the same adapters, bit for bit (routed
  experts at their own rank again)."""
  import peft
  import torch
  model = _write_checkpoint(family, str(tmp_path / "base"))
  cfg, params = hf.load(str(tmp_path / "base"))
  lora_cfg = LoraConfig(rank=4, alpha=8.0)
  adapters = _moved(lora.init_adapters(params, lora_cfg, cfg, jax.random.PRNGKey(1)), size=0.1)
  out = hf_lora.save_adapter(adapters, cfg, lora_cfg, str(tmp_path / "adapter"),
                             base=str(tmp_path / "base"))
  tokens = np.arange(12)[None] * 7 % cfg.vocab_size
  with torch.no_grad():
    base_logits = model(torch.tensor(tokens)).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(model, out).eval()
    theirs = adapted(torch.tensor(tokens)).logits.numpy()
  ours = _logits(lora.attach(params, adapters), cfg,
                 (jnp.asarray(tokens), jnp.arange(12)[None], jnp.ones((1, 12), jnp.int32)))
  assert float(np.max(np.abs(theirs - base_logits))) > 0.1  # the adapter is applied
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-5)
  back, back_cfg = hf_lora.load_adapter(out, cfg)
  assert (back_cfg.rank, back_cfg.alpha) == (4, 8.0)
  assert jax.tree.structure(back) == jax.tree.structure(adapters)  # ranks and scales too
  jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_bad_adapter_directories_name_what_is_wrong(tmp_path):
  """rsLoRA (a scale SGLang does not apply), a missing half of a pair, a tensor no kernel of
  the model has and a shape that does not fit are refused, each named."""
  cfg = config.tiny(64, hidden_size=32, intermediate_size=48)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  lora_cfg = LoraConfig(rank=4, targets=("q_proj",))
  good = hf_lora.save_adapter(lora.init_adapters(params, lora_cfg, cfg, jax.random.PRNGKey(1)),
                              cfg, lora_cfg, str(tmp_path / "good"))

  def altered(name, config=None, tensors=None):
    """A copy of the good directory with its config and tensors changed."""
    out = str(tmp_path / name)
    os.makedirs(out)
    with open(os.path.join(good, hf_lora.CONFIG)) as f:
      written = json.load(f)
    with open(os.path.join(out, hf_lora.CONFIG), "w") as f:
      json.dump({**written, **(config or {})}, f)
    with safe_open(os.path.join(good, hf_lora.WEIGHTS), "numpy") as f:
      stored = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors(stored) if tensors else stored, os.path.join(out, hf_lora.WEIGHTS))
    return out

  with pytest.raises(ValueError, match="use_rslora=True; only plain LoRA"):
    hf_lora.load_adapter(altered("rslora", {"use_rslora": True}), cfg)
  b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
  with pytest.raises(ValueError, match=f"{b} is missing"):
    hf_lora.load_adapter(altered("half", tensors=lambda t: {k: v for k, v in t.items()
                                                            if k != b}), cfg)
  extra = "base_model.model.lm_head.lora_A.weight"
  with pytest.raises(ValueError, match=f"fit no projection of this model config: .*{extra}"):
    hf_lora.load_adapter(altered("extra", tensors=lambda t: {**t, extra: t[b]}), cfg)
  with pytest.raises(ValueError, match=r"q_proj's A \(4, 32\) and B \(16, 4\) do not fit"):
    hf_lora.load_adapter(altered("shape", tensors=lambda t: {**t, b: t[b][:16]}), cfg)
  with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
    hf_lora.load_adapter(str(tmp_path), cfg)


TINY_LORA = RLConfig(prompts_per_step=4, samples_per_prompt=4, minibatches=2,
                     max_new_tokens=16, seq_len=32, learning_rate=1e-3,
                     lora=LoraConfig(rank=4, alpha=8.0))


def _lora_run(run_dir, num_steps):
  """A LoRA run with GRPO (a KL to the reference in its loss) from a short warm start, driven
  through its hooks as trainer.train does: (its train state's params, its base, the engine's
  weights, the summary)."""
  run = trainer.build(
      run_dir, task=Arithmetic(digits=1, num_train=500, num_test=16),
      model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
      rl=dataclasses.replace(TINY_LORA, num_steps=num_steps),
      objective=trainer.Objective(loss="grpo"), start=trainer.WarmStart(steps=150, batch_size=16),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), checkpoint_every=2,
                          progress=False, tensorboard=False))
  try:
    hooks_lib.drive(run)
    return (run.state.train.params, run.parts.base, run.parts.context.engine._weights[0],
            run.summary)
  finally:
    run.close()


@pytest.mark.slow
def test_a_lora_run_moves_only_its_adapters_and_resumes_exactly(tmp_path, capsys):
  """Only the adapters are trained and checkpointed; the base stays the warm start's params
  (kept in run_dir/sft), is the reference of GRPO's KL (0 before the first update, when B = 0),
  and the engine holds base and adapters merged; a run stopped and resumed ends with the
  uninterrupted run's adapters, bit for bit."""
  whole = str(tmp_path / "whole")
  adapters, base, engine_weights, summary = _lora_run(whole, 4)
  assert "LoRA: 4,096 trained parameters (rank 4, alpha 8) over a frozen base of" in (
      capsys.readouterr().out)
  kept = Checkpointer(os.path.join(whole, "sft"), max_to_keep=1)
  jax.tree.map(np.testing.assert_array_equal, base, kept.restore(base))
  kept.close()
  assert all(isinstance(x, lora.Adapter) for x in jax.tree.leaves(
      adapters, is_leaf=lambda x: isinstance(x, lora.Adapter)))
  assert max(float(jnp.max(jnp.abs(x.b))) for x in jax.tree.leaves(
      adapters, is_leaf=lambda x: isinstance(x, lora.Adapter))) > 0
  jax.tree.map(np.testing.assert_array_equal, engine_weights,
               lora.merge(lora.attach(base, adapters)))
  records = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl"))][1:]
  assert len(records) == 4 and max(r["grad_norm"] for r in records) > 0
  assert records[0]["kl_to_reference"] < 1e-6
  assert max(r["kl_to_reference"] for r in records) > 0
  saved = Checkpointer(os.path.join(whole, "checkpoints"))
  held = saved.restore_params(4)  # the train state's params: the adapters alone
  saved.close()
  assert sorted(np.shape(x) for x in jax.tree.leaves(held)) == sorted(
      np.shape(x) for x in jax.tree.leaves(adapters))
  with pytest.raises(ValueError, match="holds LoRA adapters .* not supported yet"):
    checkpoint.load_policy(whole, like=base)  # FromRun's read: refused, named
  split = str(tmp_path / "split")
  _lora_run(split, 2)
  resumed, *_ = _lora_run(split, 4)
  assert "resuming from" in capsys.readouterr().out
  jax.tree.map(np.testing.assert_array_equal, resumed, adapters)


@pytest.mark.slow
def test_a_lora_run_through_servers_syncs_adapters_and_generates_with_them(tmp_path):
  """Through our server as a subprocess (local_engine): the warm start's base goes once, then
  each step's adapters alone under a name of their version, which every request names: the
  engine's log-probs are the trainer's recomputation under the adapters (a request on the
  base would differ by the adapters' update); the two newest versions stay loaded."""
  import httpx
  from rollouts.sglang_engine import local_engine
  run = trainer.build(
      str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=500, num_test=16),
      model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
      rl=dataclasses.replace(TINY_LORA, num_steps=3, learning_rate=1e-2,
                            prompts_per_step=8, samples_per_prompt=8),
      objective=trainer.Objective(loss="grpo"), start=trainer.WarmStart(steps=400, batch_size=16),
      engine=functools.partial(local_engine, weights_dir=str(tmp_path / "weights")),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), checkpoint_every=10,
                          progress=False, tensorboard=False))
  try:
    engine = run.parts.context.engine
    hooks_lib.drive(run)
    prefix = engine.rid_prefix
    assert engine.adapter == (f"{prefix}-v3", 3)
    cards = httpx.get(engine.client.urls[0] + "/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards[1:]] == [f"{prefix}-v2", f"{prefix}-v3"]
  finally:
    run.close()
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1:]
  assert len(records) == 3 and max(r["grad_norm"] for r in records) > 0
  assert max(r["engine_logp_diff_max"] for r in records) < 1e-4, records
