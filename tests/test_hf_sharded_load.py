"""Sharded import on the 8-device host mesh: `hf.load(shardings=...)` puts every tensor of a
Hugging Face checkpoint into exactly its shards, and the load's peak host memory (measured in
a fresh process) stays below two copies of the model."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from models import config, hf, sharding, transformer
from tests.test_hf import _write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"fsdp=4 x tensor=2": dict(fsdp=4, tensor=2),
          "data=2 x fsdp=2 x tensor=2": dict(data=2, fsdp=2, tensor=2)}


@pytest.fixture(scope="module", params=["qwen2_tied", "qwen3_untied"])
def checkpoint(request, tmp_path_factory):
  """A transformers-written checkpoint (qwen2: q/k/v biases; qwen3: q/k norms, head_dim 24
  unlike hidden / heads, an lm_head) and its tensors as the file holds them."""
  path = str(tmp_path_factory.mktemp(request.param))
  _write_checkpoint(request.param, path)
  return path, load_file(os.path.join(path, hf.SINGLE))


def _checkpoint_value(keys, tensors, cfg):
  """Parameter `keys` (a path into our params) in our layout, from the checkpoint's HF
  tensors: the mapping of models/hf.py restated, so that a mix-up there cannot hide."""
  if keys == ("embed_tokens", "embedding"):
    return tensors["model.embed_tokens.weight"]
  if keys == ("lm_head",):
    return tensors["lm_head.weight"].T
  if keys == ("norm", "scale"):
    return tensors["model.norm.weight"]
  layer, *module, leaf = keys
  name = f"model.layers.{layer.removeprefix('layers_')}.{'.'.join(module)}."
  w = tensors[name + ("bias" if leaf == "bias" else "weight")]
  h, d = cfg.hidden_size, cfg.head_dim
  if module[-1] in ("q_proj", "k_proj", "v_proj"):
    return w.reshape(-1, d) if leaf == "bias" else w.T.reshape(h, -1, d)
  if module[-1] == "o_proj":
    return w.T.reshape(-1, d, h)
  return w.T if leaf == "kernel" else w  # MLP kernels; RMSNorm scales


@pytest.mark.parametrize("axes", MESHES.values(), ids=MESHES.keys())
def test_each_tensor_lands_in_exactly_its_shards(checkpoint, axes):
  path, tensors = checkpoint
  cfg = hf.read_config(path)
  mesh = sharding.make_mesh(**axes)
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  wanted = sharding.param_shardings(shapes, mesh)
  _, params = hf.load(path, shardings=wanted)
  _, unsharded = hf.load(path)
  assert jax.tree.structure(params) == jax.tree.structure(unsharded) == jax.tree.structure(shapes)
  split = 0  # parameters cut into fsdp x tensor pieces
  for (keypath, leaf), want, whole in zip(jax.tree_util.tree_leaves_with_path(params),
                                          jax.tree.leaves(wanted), jax.tree.leaves(unsharded)):
    keys = tuple(k.key for k in keypath)
    assert leaf.sharding == want, (keys, leaf.sharding, want)
    value = _checkpoint_value(keys, tensors, cfg)
    assert leaf.shape == value.shape and leaf.dtype == np.float32, keys
    assert len(leaf.addressable_shards) == 8, keys
    for shard in leaf.addressable_shards:
      assert shard.index == want.devices_indices_map(leaf.shape)[shard.device], keys
      np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], err_msg=str(keys))
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(whole), err_msg=str(keys))
    split += leaf.addressable_shards[0].data.size * mesh.shape["fsdp"] * mesh.shape[
        "tensor"] == leaf.size
  assert split >= 7 * cfg.num_layers  # at least every projection kernel


# A fresh process loads the checkpoint onto the mesh and reports its resident memory (VmRSS:
# anonymous and file-backed pages, which is what the XLA CPU buffers and safetensors' mapped
# pages add to) before the load and its peak (VmHWM) during it. Writing 5 to clear_refs resets
# the peak to the current size; where that is not allowed the peak since start is an upper
# bound.
_MEASURE = """
import json, sys
import jax
from models import hf, sharding, transformer

def status():
  fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
  return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

path = sys.argv[1]
cfg = hf.read_config(path)
mesh = sharding.make_mesh(fsdp=4, tensor=2)
shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
shardings = sharding.param_shardings(shapes, mesh)
jax.block_until_ready(jax.device_put(jax.numpy.zeros(8), shardings["norm"]["scale"]))
try:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  reset = True
except OSError:
  reset = False
before = status()
_, params = hf.load(path, shardings=shardings)
jax.block_until_ready(params)
after = status()
print(json.dumps({"before": before, "after": after, "peak_reset": reset,
                  "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
                  "device_bytes": sum(s.data.nbytes for x in jax.tree.leaves(params)
                                      for s in x.addressable_shards)}))
"""


def test_sharded_load_peak_host_memory_is_below_two_copies_of_the_model(tmp_path):
  # 64 MiB of float32 in one file (the case where a reader that keeps the file mapped holds
  # a second copy), large enough that the model dominates allocator noise.
  cfg = config.ModelConfig(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=4, head_dim=64, intermediate_size=1536,
                           tie_embeddings=False)
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes)
  path = hf.save(params, cfg, str(tmp_path / "ckpt"))
  checkpoint_bytes = os.path.getsize(os.path.join(path, hf.SINGLE))
  del params
  result = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  model = report["param_bytes"]
  assert model > 60 * 2**20 and abs(checkpoint_bytes - model) < 2**20  # float32 both sides
  assert report["device_bytes"] < 1.01 * model  # split, not replicated, over the 8 devices
  peak = report["after"]["VmHWM"] - report["before"]["VmRSS"]
  print(f"checkpoint {checkpoint_bytes / 2**20:.1f} MiB, params {model / 2**20:.1f} MiB, peak "
        f"host RSS growth during the load {peak / 2**20:.1f} MiB = {peak / model:.2f} x the "
        f"model (peak reset: {report['peak_reset']}), {json.dumps(report)}")
  # The params themselves are one copy (XLA's CPU devices live in host memory); everything
  # the load holds on the side must stay below another.
  assert peak < 2 * model, report
