"""The C++ attention kernels for XLA:CPU (models/attention/cpu.py): they build here, equal the
dense reference (training attention forward and backward, decode attention), are what dispatch
runs on CPU, split over a mesh, and a failed build falls back with its reason."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import sharding, transformer
from models.attention import cpu, dispatch, reference
from tests.test_attention import CASES, _inputs, assert_matches_dense_on, ring_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_build_on_this_machine():
  # CI has g++ (scripts/setup.sh's machine); without a compiler the kernels fall back, and this
  # test says why instead of letting the slower path pass unnoticed.
  assert cpu.available(), cpu.unavailable_reason()


# test_attention's cases (tiles of 16 there; the kernel's own blocks: 128 / group query
# positions against 64 keys) and ones that cross its blocks: (batch, seq, heads, kv_heads,
# head_dim, segment rows).
TRAIN_CASES = {
    **{name: case[:6] for name, case in CASES.items()},
    "head_dim_64_five_key_blocks": (2, 300, 8, 2, 64,
                                    [[1] * 150 + [2] * 100 + [0] * 50, [1] * 300]),
    "one_query_head_per_kv_head_dim_24": (1, 130, 3, 3, 24, None),
    "padding_inside_a_row": (1, 100, 4, 1, 16, [[1] * 30 + [0] * 10 + [2] * 60]),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_attention_equals_dense(case):
  *shape, segments = TRAIN_CASES[case]
  assert_matches_dense_on(cpu.attention, shape, segments)


def test_training_attention_runs_the_kernel_per_device_on_a_mesh():
  q, k, v, seg, _ = _inputs(8, 32, 4, 2, 16, None)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  with jax.set_mesh(mesh):
    hlo = jax.jit(lambda q, k, v: dispatch.attention(q, k, v, seg)).lower(q, k, v).compile()
  call = [line for line in hlo.as_text().splitlines() if "longrl_flash_forward" in line]
  assert len(call) == 1
  # Each device takes its 2 rows (data x fsdp = 4 ways) and 2 of the 4 query heads with their
  # KV head (tensor): the output and logsumexp of one device's share.
  assert "(f32[2,32,2,16]{3,2,1,0}, f32[2,32,2]{2,1,0}) custom-call" in call[0]
  *shape, segments, _, _ = CASES["gqa_8_over_2"]
  assert_matches_dense_on(cpu.attention, shape, segments, mesh)


@pytest.mark.parametrize("context", [2, 4])
def test_ring_over_the_kernel_equals_dense_across_its_blocks(context):
  """Ring attention folding key/value chunks with the kernel, chunks of 512 and 256 tokens:
  several of its query and key blocks per chunk, zigzag positions (each device's queries are
  two separate stretches of the row), documents crossing chunks, padding and grouped heads,
  so that its skipped, partly visible and wholly visible block pairs all occur."""
  segments = [[1] * 300 + [2] * 500 + [3] * 200 + [0] * 24]
  mesh = sharding.make_mesh(context=context)
  assert_matches_dense_on(ring_fn(context, "cpu"), (1, 1024, 8, 2, 32), segments, mesh)
  with jax.set_mesh(mesh):
    assert dispatch.plan("auto", context) == "ring/cpu"


# (batch, q_len, heads, kv_heads, cache_len, head_dim): head_dim 64 runs 16-lane vectors only,
# 8, 24 and 40 their scalar tails; q_len > 1 is the causal rule inside a multi-token write.
DECODE_CASES = [(8, 1, 8, 2, 48, 64), (3, 1, 4, 2, 37, 8), (2, 3, 6, 3, 20, 24),
                (2, 2, 2, 1, 9, 40)]


@pytest.mark.parametrize("shape", DECODE_CASES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_equals_reference(shape):
  b, q_len, h, kh, slots, d = shape
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, q_len, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, kh, slots, d)), jnp.float32) for _ in "kv")
  kv_valid = rng.random((b, slots)) > 0.3
  kv_valid[0] = False  # a row that sees no key outputs zeros
  kv_valid = jnp.asarray(kv_valid)
  decode = jax.jit(cpu.decode_attention)
  # The first slot, the middle, the last write that fits, and writes past the cache's end.
  for first_slot in (0, slots // 2, slots - q_len, slots - 1, slots + 2):
    want = reference.cached_attention(q, k, v, reference.cache_mask(kv_valid, first_slot, q_len))
    got = decode(q, k, v, kv_valid, first_slot)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"slot {first_slot}")
    assert not np.any(np.asarray(got[0])), "a row with no valid slot must output zeros"


def test_decode_attention_reads_no_slot_past_the_last_query():
  # Garbage (NaN) in the slots after the write must not reach the output: the kernel stops at
  # the last query's slot, where the reference masks them.
  b, h, kh, slots, d = 2, 4, 2, 16, 16
  q = jnp.ones((b, 1, h, d))
  k = jnp.ones((b, kh, slots, d)).at[:, :, 6:].set(jnp.nan)
  v = jnp.ones((b, kh, slots, d)).at[:, :, 6:].set(jnp.nan)
  out = jax.jit(cpu.decode_attention)(q, k, v, jnp.ones((b, slots), bool), 5)
  np.testing.assert_allclose(out, 1.0)


def _decode_hlo(cfg, params):
  cache = transformer.init_cache(cfg, 2, 8)
  token, pos = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)
  run = jax.jit(lambda p, c, valid: transformer.decode(p, cfg, token, pos, valid, c, 3)[:2])
  return run.lower(params, cache, jnp.ones((2, 8), bool)).as_text()


def test_decode_steps_run_the_kernel_on_cpu_unless_dense(tiny_cfg, tiny_params):
  assert "longrl_decode_attention" in _decode_hlo(tiny_cfg, tiny_params)
  dense = dataclasses.replace(tiny_cfg, attention="dense")
  assert "longrl_decode_attention" not in _decode_hlo(dense, tiny_params)


def test_kernel_decoding_equals_reference_decoding(tiny_cfg, tiny_params):
  # The embedded engine end to end: greedy tokens and their log-probs with the kernel and
  # with the dense reference (left-padded prompts of different lengths).
  from rollouts.engine import SamplingParams
  from rollouts.jax_engine import JaxEngine

  prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
  sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
  got = JaxEngine(tiny_cfg, tiny_params).generate(prompts, sampling, seed=0)
  dense = dataclasses.replace(tiny_cfg, attention="dense")
  want = JaxEngine(dense, tiny_params).generate(prompts, sampling, seed=0)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.token_ids, w.token_ids)
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_failed_build_falls_back_and_says_why(tmp_path):
  script = (
      "import jax, jax.numpy as jnp\n"
      "from models.attention import cpu, dispatch, reference\n"
      "assert not cpu.available()\n"
      "print(cpu.unavailable_reason())\n"
      "q = jnp.ones((1, 1, 2, 8)); k = jnp.ones((1, 1, 4, 8)); valid = jnp.ones((1, 4), bool)\n"
      "out = dispatch.cached_attention(q, k, k, valid, 2)\n"
      "want = reference.cached_attention(q, k, k, reference.cache_mask(valid, 2, 1))\n"
      "assert jnp.allclose(out, want)\n")
  env = dict(os.environ, CXX="no-such-compiler", LONGRL_CACHE=str(tmp_path),
             PYTHONPATH=ROOT)
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "no-such-compiler" in result.stdout
  assert "C++ CPU kernels unavailable" in result.stderr  # the warning names the fallback
  assert not list(tmp_path.iterdir())  # nothing half-built left behind


def test_unwritable_cache_builds_in_the_temporary_directory(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("LONGRL_CACHE", str(blocker / "cache"))  # cannot be made: a file's child
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  library = cpu._build()
  assert library.parent.parent == tmp_path / "tmp" and library.exists()
