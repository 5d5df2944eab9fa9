"""Attention kernels against the dense reference: blockwise, ring (8 simulated devices), the
vendor-kernel calls, dispatch rules, and a whole train step under context parallelism."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import config, sharding, transformer
from models.attention import blockwise, dispatch, reference, ring
from rl import losses
from rl.train_step import init_train_state, make_train_step
from rl.types import TrainBatch

TOL = dict(atol=1e-5, rtol=1e-5)

# (name, batch, seq, heads, kv_heads, head_dim, segment rows, block_q, block_k)
CASES = {
    "causal": (2, 64, 4, 4, 16, None, 16, 16),
    "packed": (2, 64, 4, 4, 16, [[1] * 20 + [2] * 30 + [3] * 10 + [0] * 4,
                                 [1] * 5 + [2] * 59], 16, 16),
    "gqa_8_over_2": (2, 48, 8, 2, 16, [[1] * 40 + [0] * 8, [1] * 48], 16, 16),
    "ragged_length": (2, 37, 4, 2, 8, [[1] * 10 + [2] * 20 + [0] * 7, [1] * 37], 8, 16),
}


def _inputs(batch, seq, heads, kv_heads, head_dim, segments, seed=0):
  kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim))
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim))
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim))
  seg = jnp.ones((batch, seq), jnp.int32) if segments is None else jnp.asarray(segments)
  cotangent = jax.random.normal(kw, q.shape)
  return q, k, v, seg, cotangent


def _dense(q, k, v, seg):
  return reference.attention(q, k, v, reference.segment_causal_mask(seg))


def _value_and_grads(fn, q, k, v, seg, cotangent, mesh=None):
  def run(q, k, v, seg, cotangent):
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, pullback(cotangent)

  with sharding.use(mesh):
    return jax.jit(run)(q, k, v, seg, cotangent)


def _assert_matches_dense(fn, case, mesh=None):
  *shape, segments, _, _ = CASES[case]
  assert_matches_dense_on(fn, shape, segments, mesh)


def assert_matches_dense_on(fn, shape, segments, mesh=None):
  """fn's output and q/k/v gradients equal the dense reference's on random inputs of shape
  (batch, seq, heads, kv_heads, head_dim), with rows of `segments` (None: one segment)."""
  q, k, v, seg, cot = _inputs(*shape, segments)
  want_out, want_grads = _value_and_grads(_dense, q, k, v, seg, cot)
  out, grads = _value_and_grads(fn, q, k, v, seg, cot, mesh)
  np.testing.assert_allclose(out, want_out, **TOL)
  for name, got, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"d{name}")


def test_dense_reference_outputs_zero_for_padding():
  q, k, v, seg, _ = _inputs(*CASES["packed"][:5], CASES["packed"][5])
  out = _dense(q, k, v, seg)
  np.testing.assert_array_equal(out[0, -4:], 0.0)
  assert np.abs(out[0, :-4]).min(axis=(-1, -2)).max() > 0


@pytest.mark.parametrize("tile_loops", ["unrolled", "looped"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_equals_dense(case, tile_loops, monkeypatch):
  # Every case has at most 16 tile pairs, unrolled by default; looped, the same tiles run in
  # lax loops, as longer sequences do.
  monkeypatch.setattr(blockwise, "UNROLL_TILES", 16 if tile_loops == "unrolled" else 0)
  block_q, block_k = CASES[case][-2:]
  _assert_matches_dense(
      lambda q, k, v, seg: blockwise.attention(q, k, v, seg, block_q=block_q, block_k=block_k),
      case)


@pytest.mark.parametrize("tile_loops", ["unrolled", "looped"])
def test_blockwise_without_causality_sees_the_whole_segment(tile_loops, monkeypatch):
  """causal=False (the vision tower's windows and images): each query attends to every key
  of its segment, before or after it, as the dense reference with that mask; interleaved
  segments (windows of one image are not contiguous) and padding included."""
  monkeypatch.setattr(blockwise, "UNROLL_TILES", 16 if tile_loops == "unrolled" else 0)
  segments = [[1, 2] * 12 + [3] * 20 + [0] * 8, [4] * 30 + [5, 6, 5, 6] * 4 + [0] * 6]

  def bidirectional(q, k, v, seg):
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, :, None]
    return reference.attention(q, k, v, mask)

  q, k, v, seg, cot = _inputs(2, 52, 4, 2, 8, segments)
  want_out, want_grads = _value_and_grads(bidirectional, q, k, v, seg, cot)
  out, grads = _value_and_grads(lambda q, k, v, seg: blockwise.attention(
      q, k, v, seg, causal=False, block_q=16, block_k=8), q, k, v, seg, cot)
  np.testing.assert_allclose(out, want_out, **TOL)
  for name, got, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"d{name}")
  np.testing.assert_array_equal(out[0, -8:], 0.0)


def test_blockwise_skips_masked_tiles_without_changing_results():
  """One tile per sequence is the same computation with nothing to skip."""
  q, k, v, seg, _ = _inputs(*CASES["packed"][:5], CASES["packed"][5])
  small = blockwise.attention(q, k, v, seg, block_q=8, block_k=8)
  whole = blockwise.attention(q, k, v, seg, block_q=64, block_k=64)
  np.testing.assert_allclose(small, whole, **TOL)


def test_blockwise_memory_is_linear_in_sequence_length():
  """The compiled forward+backward's temporaries grow ~linearly (dense: quadratically)."""
  def temp_bytes(fn, seq):
    q = jnp.zeros((1, seq, 2, 16))
    k = jnp.zeros((1, seq, 1, 16))
    seg = jnp.ones((1, seq), jnp.int32)
    grad = jax.jit(jax.grad(lambda q, k: jnp.sum(fn(q, k, k, seg)), argnums=(0, 1)))
    return grad.lower(q, k).compile().memory_analysis().temp_size_in_bytes

  flash = lambda q, k, v, s: blockwise.attention(q, k, v, s, block_q=128, block_k=128)
  assert temp_bytes(flash, 4096) / temp_bytes(flash, 1024) < 4.5
  assert temp_bytes(_dense, 4096) / temp_bytes(_dense, 1024) > 12


def test_blockwise_memory_is_linear_under_a_scan_of_rematerialised_layers():
  """As models/transformer.py's `scan_layers`: partial evaluation of the layer scan hoists what
  depends only on its loop invariants (segment ids); the forward's tile loop must not hand it
  per-tile masks to stack (quadratic: 3.8x from 1k to 2k tokens before the fix)."""
  def temp_bytes(seq):
    q = jax.ShapeDtypeStruct((1, seq, 4, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, seg):
      layer = lambda x, _: (jnp.tanh(blockwise.attention(x, k, k, seg, block_q=32,
                                                          block_k=32)), None)
      out = jax.lax.scan(jax.checkpoint(layer, prevent_cse=False), q, length=2)[0]
      return jnp.sum(out * out)  # nonlinear: the backward pass needs the forward's output

    compiled = jax.jit(jax.grad(loss)).lower(q, k, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(2048) / temp_bytes(1024) < 2.5


def test_zigzag_layout_round_trips_and_balances_causal_work():
  seq, context = 64, 4
  order = ring.zigzag_order(seq, context)
  assert sorted(order) == list(range(seq))
  x = jnp.arange(2 * 30).reshape(2, 30)
  np.testing.assert_array_equal(ring.from_zigzag(ring.to_zigzag(x, context), 30, context), x)
  # Visible (query, key) pairs per device: equal under the zigzag layout.
  chunks = order.reshape(context, -1)
  work = [int(np.sum(c[:, None] >= np.arange(seq)[None, :])) for c in chunks]
  assert len(set(work)) == 1, work
  with pytest.raises(ValueError, match="divisible by 2 x context"):
    ring.zigzag_order(30, 4)


MESHES = {"context=8": dict(context=8), "data=2 x context=4": dict(data=2, context=4),
          "data=2 x tensor=2 x context=2": dict(data=2, tensor=2, context=2)}


def ring_fn(context, chunks="blockwise", block=4):
  """Ring attention over rows in their own order (zigzagged in, back out)."""
  def fn(q, k, v, seg):
    z = lambda x: ring.to_zigzag(x, context)
    out = ring.attention(z(q), z(k), z(v), z(seg), chunks=chunks, block_q=block, block_k=block)
    return ring.from_zigzag(out, q.shape[1], context)

  return fn


@pytest.mark.parametrize("mesh_name,case,chunks", [
    *((mesh, case, chunks) for chunks in ("blockwise", "cpu")
      for mesh in ("context=8", "data=2 x context=4") for case in sorted(CASES)),
    *(("context=8", case, "pallas_gpu") for case in sorted(CASES)),  # interpret mode: slower
    *(("data=2 x tensor=2 x context=2", "gqa_8_over_2", chunks)
      for chunks in sorted(ring.CHUNK_KERNELS))])
def test_ring_equals_dense(mesh_name, case, chunks):
  """Over blockwise tiles (of 4), over the C++ kernel (tests/test_cpu_kernels.py has it across
  the kernel's own blocks) and over our Pallas GPU kernel in interpret mode (the chunks sit in
  the corner of its 64-token tiles, the rest padding)."""
  mesh = sharding.make_mesh(**MESHES[mesh_name])
  _assert_matches_dense(ring_fn(mesh.shape["context"], chunks), case, mesh)


def test_vendor_kernel_calls_equal_dense():
  """The cuDNN call (run through XLA's implementation) and splash (Pallas interpret mode) are
  built with the right masks, GQA layout and scaling; on GPU/TPU only the backend changes."""
  cudnn_via_xla = lambda q, k, v, s: dispatch.cudnn_attention(q, k, v, s, implementation="xla")
  _assert_matches_dense(cudnn_via_xla, "packed")
  _assert_matches_dense(cudnn_via_xla, "gqa_8_over_2")
  _assert_matches_dense(
      lambda q, k, v, s: dispatch.splash_attention(q, k, v, s, interpret=True), "ragged_length")


@pytest.mark.parametrize("case", ["packed", "gqa_8_over_2", "ragged_length"])
def test_pallas_gpu_kernel_equals_dense(case):
  """JAX's Pallas flash attention for GPUs, in interpret mode: packed documents by segment id
  (no mask), padding, grouped KV heads and a length off its tiles, forward and the three
  gradients; on a GPU only the lowering changes (Triton)."""
  _assert_matches_dense(
      lambda q, k, v, s: dispatch.pallas_gpu_attention(q, k, v, s, interpret=True), case)


def test_pallas_gpu_kernel_in_bf16_is_within_bf16_of_dense():
  """The same in bfloat16 (the dtypes it takes), against the float32 reference."""
  *shape, segments, _, _ = CASES["packed"]
  q, k, v, seg, cot = _inputs(*shape, segments)
  want, want_grads = _value_and_grads(_dense, q, k, v, seg, cot)
  half = lambda x: x.astype(jnp.bfloat16)
  out, grads = _value_and_grads(
      lambda q, k, v, s: dispatch.pallas_gpu_attention(q, k, v, s, interpret=True),
      half(q), half(k), half(v), seg, half(cot))
  np.testing.assert_allclose(np.float32(out), want, atol=3e-2, rtol=3e-2)
  for name, got, expected in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(np.float32(got), expected, atol=1e-1, rtol=5e-2,
                               err_msg=f"d{name}")


def test_ring_over_our_pallas_gpu_kernel_across_its_tiles_in_bf16():
  """models/attention/pallas_gpu.py in Pallas interpret mode (Triton on a GPU): chunks of 256
  tokens (4 of its tiles each way, zigzag positions, documents crossing chunks, padding,
  grouped heads) in bfloat16, against the float32 reference."""
  segments = [[1] * 300 + [2] * 500 + [3] * 200 + [0] * 24]
  q, k, v, seg, cot = _inputs(1, 1024, 4, 2, 32, segments)
  want, want_grads = _value_and_grads(_dense, q, k, v, seg, cot)
  half = lambda x: x.astype(jnp.bfloat16)
  out, grads = _value_and_grads(ring_fn(2, "pallas_gpu"), half(q), half(k), half(v), seg,
                                half(cot), sharding.make_mesh(context=2))
  np.testing.assert_allclose(np.float32(out), want, atol=3e-2, rtol=3e-2)
  for name, got, expected in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(np.float32(got), expected, atol=1e-1, rtol=5e-2,
                               err_msg=f"d{name}")


def test_dispatch_rules_on_cpu():
  assert dispatch.resolve("auto", "cpu") == "cpu"  # the C++ kernel (tests/test_cpu_kernels.py)
  assert dispatch.resolve("dense", "cpu") == "dense"
  q, k, v, seg, _ = _inputs(*CASES["packed"][:5], CASES["packed"][5])
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  with pytest.raises(dispatch.KernelUnavailable, match="attention='cpu' takes float32"):
    dispatch.attention(*bf16, seg, kernel="cpu")
  with pytest.raises(dispatch.KernelUnavailable, match="computes in bfloat16"):
    dispatch.plan("cpu", 1, jnp.bfloat16)  # what rl.trainer.train checks before compiling
  assert dispatch.plan("auto", 1, jnp.bfloat16) == "blockwise"
  # auto takes what the C++ kernel does not to blockwise (bf16 here).
  assert "longrl_flash" not in jax.jit(lambda *x: dispatch.attention(*x, seg)).lower(*bf16).as_text()
  for kernel, needs in (("cudnn", "GPU"), ("pallas_gpu", "GPU"), ("splash", "TPU")):
    with pytest.raises(dispatch.KernelUnavailable, match=needs):
      dispatch.resolve(kernel, "cpu")
  with pytest.raises(ValueError, match="unknown attention kernel 'flash3'"):
    dispatch.resolve("flash3", "cpu")
  with pytest.raises(ValueError, match="ModelConfig.attention='flash3'"):
    config.tiny(55, attention="flash3")
  with jax.set_mesh(sharding.make_mesh(context=2)):
    with pytest.raises(dispatch.KernelUnavailable, match="cannot run context-parallel"):
      dispatch.attention(q, k, v, seg, kernel="dense")
  # Context-parallel: the ring folds chunks with the C++ kernel where it runs, else blockwise.
  assert dispatch.plan("auto", 8, jnp.float32) == "ring/cpu"
  assert dispatch.plan("auto", 8, jnp.bfloat16) == "ring/blockwise"
  assert dispatch.plan("blockwise", 8, jnp.float32) == "ring/blockwise"
  with pytest.raises(dispatch.KernelUnavailable, match="computes in bfloat16"):
    dispatch.plan("cpu", 8, jnp.bfloat16)


def test_dispatch_takes_float32_past_cudnn(monkeypatch):
  """cuDNN's fused attention takes bf16 and f16 only: on a GPU (where resolve picks cudnn)
  auto runs a float32 model blockwise and an explicit cudnn says why it cannot. The GPU run
  of bench/gpu_checks.py checks the same on the real kernel."""
  monkeypatch.setattr(dispatch, "resolve", lambda kernel, backend: "cudnn")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert dispatch.plan("auto", 8, jnp.bfloat16) == "ring/blockwise"
  assert dispatch.plan("auto", 1, jnp.float32) == "blockwise"
  assert dispatch.plan("auto", 1, jnp.bfloat16) == "cudnn"
  with pytest.raises(dispatch.KernelUnavailable, match="'cudnn' takes bfloat16 or float16"):
    dispatch.plan("cudnn", 1, jnp.float32)


def test_make_mesh_names_missing_devices():
  with pytest.raises(sharding.MeshUnavailable, match="needs 16 devices.*device_count=16"):
    sharding.make_mesh(data=2, context=8)


def test_model_kernels_agree(tiny_cfg, tiny_params):
  tokens = jnp.asarray([[1, 5, 6, 7, 8, 1, 9, 10, 0, 0], [1, 4, 4, 4, 4, 4, 4, 4, 4, 3]])
  seg = jnp.asarray([[1] * 5 + [2] * 3 + [0] * 2, [1] * 10])
  pos = jnp.asarray([list(range(5)) + list(range(3)) + [0, 0], list(range(10))])
  hidden = {kernel: transformer.forward(tiny_params, config.tiny(**_tiny_kw(tiny_cfg, kernel)),
                                        tokens, pos, seg)
            for kernel in ("dense", "blockwise", "cpu")}
  np.testing.assert_allclose(hidden["dense"], hidden["blockwise"], **TOL)
  np.testing.assert_allclose(hidden["dense"], hidden["cpu"], **TOL)


def _tiny_kw(cfg, kernel):
  return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
              intermediate_size=cfg.intermediate_size, attention=kernel)


def _packed_batch(rows, seq, vocab, seed=0):
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, seq), np.int32)
  pos = np.zeros((rows, seq), np.int32)
  for r in range(rows):
    start, s = 0, 1
    while start < seq - 6:
      n = int(rng.integers(4, 20))
      n = min(n, seq - 3 - start)
      seg[r, start:start + n] = s
      pos[r, start:start + n] = np.arange(n)
      start, s = start + n, s + 1
  tokens = rng.integers(3, vocab, (rows, seq)).astype(np.int32) * (seg > 0)
  targets = np.roll(tokens, -1, axis=1) * (seg > 0)
  loss_mask = ((seg > 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
  return TrainBatch(tokens=jnp.asarray(tokens), targets=jnp.asarray(targets),
                    positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg),
                    loss_mask=jnp.asarray(loss_mask),
                    old_logp=jnp.asarray(rng.normal(-3, 0.3, (rows, seq)), jnp.float32),
                    advantages=jnp.asarray(rng.normal(size=(rows, seq)), jnp.float32))


def gradient_recorder() -> optax.GradientTransformation:
  """An optimizer that leaves params alone and keeps the last gradients as its state, so a
  train step's gradients can be compared exactly."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def assert_same_gradients(got, want, rtol=1e-5):
  """Leaf by leaf, relative to the leaf's largest gradient."""
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    w, g = np.asarray(w), np.asarray(g)
    np.testing.assert_allclose(g, w, atol=rtol * (np.abs(w).max() or 1.0), rtol=0,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh_axes,remat", [(dict(context=8), "none"),
                                             (dict(data=2, context=4), "none"),
                                             (dict(context=8), "full")],
                         ids=["context=8", "data=2 x context=4",
                              "context=8, layers rematerialised (a scan)"])
def test_train_step_with_ring_attention_equals_one_device(tiny_cfg, tiny_params, mesh_axes,
                                                          remat):
  batch = _packed_batch(rows=4, seq=60, vocab=tiny_cfg.vocab_size)
  optimizer = gradient_recorder()
  loss_fn = losses.bind("k1.5", None)
  state = init_train_state(tiny_params, optimizer)
  one, one_metrics = make_train_step(tiny_cfg, optimizer, loss_fn)(state, batch)
  cfg = dataclasses.replace(tiny_cfg, remat=remat)
  step = sharding.on_mesh(sharding.make_mesh(**mesh_axes),
                          make_train_step(cfg, optimizer, loss_fn))
  sharded, metrics = step(state, batch)
  for key in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(metrics[key], one_metrics[key], rtol=1e-5, err_msg=key)
  assert_same_gradients(sharded.opt_state, one.opt_state)
