"""Losses against their published formulas, computed by hand on a tiny packed batch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl import ConfigError, advantages, losses
from rl.packing import trajectory_batch
from rl.train_step import init_train_state, make_train_step
from rl.types import TrainBatch

# One row holding two trajectories (segments 1 and 2) and one padding position.
SEGMENTS = [1, 1, 1, 2, 2, 2, 0]
MASK = [0, 1, 1, 0, 1, 1, 0]  # the first target of each trajectory is still prompt
LOGP = [-1.0, -0.5, -1.2, -2.0, -0.3, -0.9, -4.0]
OLD = [-1.0, -0.7, -1.0, -2.0, -0.4, -0.6, 0.0]
REF = [-1.0, -0.6, -1.5, -2.0, -0.2, -0.8, 0.0]
ADV = [0.5, 0.5, 0.5, -0.5, -0.5, -0.5, 0.0]


def _batch():
  row = lambda v, dt=jnp.float32: jnp.asarray([v], dt)
  return TrainBatch(tokens=row([0] * 7, jnp.int32), targets=row([0] * 7, jnp.int32),
                    positions=row([0, 1, 2, 0, 1, 2, 0], jnp.int32),
                    segment_ids=row(SEGMENTS, jnp.int32), loss_mask=row(MASK),
                    old_logp=row(OLD), advantages=row(ADV), ref_logp=row(REF))


def _trajectories():
  """(advantage, [(logp, old, ref), ...] over masked tokens) per trajectory."""
  out = {}
  for t, seg in enumerate(SEGMENTS):
    if seg and MASK[t]:
      out.setdefault(seg, (ADV[t], []))[1].append((LOGP[t], OLD[t], REF[t]))
  return list(out.values())


def test_k15_matches_hand_computation():
  tau = 0.1
  expected = []
  for adv, tokens in _trajectories():
    delta = sum(lp - old for lp, old, _ in tokens)
    expected.append((adv - tau * delta) ** 2 / (2 * tau))
  weighted, _ = losses.get("k1.5").fn(jnp.asarray([LOGP]), _batch(), tau=tau)
  assert float(weighted.count) == 2
  np.testing.assert_allclose(float(weighted.total), sum(expected), rtol=1e-6)


def test_k15_gradient_is_minus_paper_eq3():
  """grad = -(A - tau * Delta) * grad Delta; at Delta = 0 it is the REINFORCE direction."""
  tau = 0.1
  batch = _batch()
  grad = jax.grad(lambda lp: losses.get("k1.5").fn(lp, batch, tau=tau)[0].total)(
      jnp.asarray([LOGP]))[0]
  for seg, (adv, tokens) in zip((1, 2), _trajectories()):
    delta = sum(lp - old for lp, old, _ in tokens)
    for t in range(7):
      if SEGMENTS[t] == seg:
        want = -(adv - tau * delta) * MASK[t]
        np.testing.assert_allclose(float(grad[t]), want, rtol=1e-6, atol=1e-7)
  assert float(grad[6]) == 0.0  # padding


def test_grpo_matches_hand_computation():
  eps, beta = 0.2, 0.04
  per_seq = []
  for adv, tokens in _trajectories():
    token_losses = []
    for lp, old, ref in tokens:
      ratio = math.exp(lp - old)
      pg = -min(ratio * adv, min(max(ratio, 1 - eps), 1 + eps) * adv)
      kl = math.exp(ref - lp) - (ref - lp) - 1  # pi_ref/pi - log(pi_ref/pi) - 1
      token_losses.append(pg + beta * kl)
    per_seq.append(sum(token_losses) / len(token_losses))
  weighted, metrics = losses.get("grpo").fn(jnp.asarray([LOGP]), _batch(), clip_eps=eps,
                                            kl_coef=beta)
  assert float(weighted.count) == 2
  np.testing.assert_allclose(float(weighted.total), sum(per_seq), rtol=1e-6)
  assert set(metrics) >= {"clip_fraction", "ratio", "kl"}


def test_grpo_without_reference_fails_clearly():
  batch = _batch().replace(ref_logp=None)
  with pytest.raises(ValueError, match="reference"):
    losses.get("grpo").fn(jnp.asarray([LOGP]), batch)
  losses.get("grpo").fn(jnp.asarray([LOGP]), batch, kl_coef=0.0)  # no KL, no reference needed


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-mean", ((1 + 2) / 2 + (3 + 4) / 2) / 2),
    ("seq-mean-token-sum", ((1 + 2) + (3 + 4)) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + (3 + 4)) / 2 / 10),
])
def test_aggregation_modes(mode, expected):
  token_loss = jnp.asarray([[9.0, 1, 2, 9, 3, 4, 9]])
  w = losses.aggregate(token_loss, _batch(), mode, norm_length=10)
  np.testing.assert_allclose(float(w.total / w.count), expected, rtol=1e-6)


def test_registry_errors_name_the_problem():
  with pytest.raises(ConfigError, match="unknown loss 'k2'.*grpo.*k1.5"):
    losses.get("k2")
  with pytest.raises(ConfigError, match="no hyper-parameter.*'taus'"):
    losses.bind("k1.5", {"taus": 1.0})
  with pytest.raises(ValueError, match="twice"):
    losses.register("k1.5", advantage="mean_baseline")(lambda logp, batch: None)


def test_advantages_by_hand():
  reward = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
  groups = jnp.asarray([0, 0, 0, 1, 1, 2])
  np.testing.assert_allclose(advantages.mean_baseline(reward, groups, 3),
                             [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
  std0 = np.std([1.0, 0.0, 0.0], ddof=1)
  np.testing.assert_allclose(
      advantages.group_normalized(reward, groups, 3),
      [(2 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6), 0, 0,
       0.5 / (1 + 1e-6)], rtol=1e-5)  # the singleton group uses mean 0, std 1


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_train_step_is_invariant_to_micro_batching(name, tiny_cfg, tiny_params):
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 40, rng.integers(1, 5)).tolist() for _ in range(8)]
  completions = [rng.integers(3, 40, rng.integers(1, 9)).tolist() for _ in range(8)]
  logp = [rng.normal(-2, 0.5, len(c)).astype(np.float32) for c in completions]
  adv = rng.normal(size=8).tolist()
  batch, _ = trajectory_batch(prompts, completions, logp, adv, [True] * 7 + [False], seq_len=16,
                              row_multiple=4)
  batch = jax.tree.map(jnp.asarray, batch)
  optimizer = optax.sgd(0.1)
  loss_fn = losses.bind(name)
  results = []
  for micro in (1, 2, 4):
    step = make_train_step(tiny_cfg, optimizer, loss_fn, micro_batches=micro)
    state, metrics = step(init_train_state(tiny_params, optimizer), batch, tiny_params)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    results.append((state.params, float(metrics["loss"])))
  for params, loss in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, results[0][0])
