"""Losses against their published formulas, computed by hand on a tiny packed batch."""

import math
import re

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
TEACHER = [-1.0, -0.2, -9.0, -2.0, -0.4, -0.1, 0.0]  # teacher - old: 0.5, -8, 0, 0.5 on the mask


def _batch():
  row = lambda v, dt=jnp.float32: jnp.asarray([v], dt)
  return TrainBatch(tokens=row([0] * 7, jnp.int32), targets=row([0] * 7, jnp.int32),
                    positions=row([0, 1, 2, 0, 1, 2, 0], jnp.int32),
                    segment_ids=row(SEGMENTS, jnp.int32), loss_mask=row(MASK),
                    old_logp=row(OLD), advantages=row(ADV), ref_logp=row(REF),
                    teacher_logp=row(TEACHER))


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


@pytest.mark.parametrize("reward_weight", [0.0, 0.5])
def test_on_policy_distillation_matches_hand_computation(reward_weight):
  """A_t = clip(teacher - old, -5, 5) + w A_outcome in PPO's clipped surrogate, token mean;
  at the sampling policy (ratio 1) the gradient is -m A_t / sum(m) on every token."""
  eps, clip = 0.2, 5.0
  dense = [min(max(t - o, -clip), clip) + reward_weight * a for t, o, a in zip(TEACHER, OLD, ADV)]
  fn = lambda lp: losses.get("opd").fn(lp, _batch(), reward_weight=reward_weight)[0]
  expected = 0.0
  for lp, old, a, m in zip(LOGP, OLD, dense, MASK):
    ratio = math.exp(lp - old)
    expected += m * -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
  weighted = fn(jnp.asarray([LOGP]))
  assert float(weighted.count) == sum(MASK)
  np.testing.assert_allclose(float(weighted.total), expected, rtol=1e-5)
  grad = jax.grad(lambda lp: fn(lp).total / fn(lp).count)(jnp.asarray([OLD]))[0]
  np.testing.assert_allclose(grad, [-m * a / sum(MASK) for m, a in zip(MASK, dense)], atol=1e-6)
  with pytest.raises(ValueError, match="needs teacher log-probs"):
    losses.get("opd").fn(jnp.asarray([LOGP]), _batch().replace(teacher_logp=None))


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
  assert set(metrics) >= {"clip_fraction", "kl"}


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


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
@pytest.mark.parametrize("name", losses.rollout_losses())
def test_every_rollout_loss_runs_in_every_aggregation_mode_it_accepts(name, mode):
  """A loss whose aggregation is a choice runs jitted with finite value and gradient in every
  mode, `seq-mean-token-sum-norm` with the row length or a given norm_length; a loss whose
  aggregation is part of its definition refuses the binding."""
  if "aggregation" not in losses.hyperparameters(name):
    with pytest.raises(ConfigError, match=rf"loss {re.escape(repr(name))} has no "
                                          r"hyper-parameter\(s\) \['aggregation'\]"):
      losses.bind(name, {"aggregation": mode})
    return

  def mean_loss(hparams):
    loss_fn = losses.bind(name, hparams)

    def mean(logp):
      weighted, _ = loss_fn(logp, _batch())
      return weighted.total / weighted.count

    value, grad = jax.jit(jax.value_and_grad(mean))(jnp.asarray([LOGP]))
    assert np.isfinite(float(value)) and np.isfinite(grad).all(), hparams
    return float(value)

  value = mean_loss({"aggregation": mode})
  if mode == "seq-mean-token-sum-norm":
    summed = mean_loss({"aggregation": "seq-mean-token-sum"})
    np.testing.assert_allclose(value, summed / 7, rtol=1e-5)  # the row length
    np.testing.assert_allclose(mean_loss({"aggregation": mode, "norm_length": 10}), summed / 10,
                               rtol=1e-5)


def test_bad_aggregation_bindings_fail_when_the_loss_is_bound():
  with pytest.raises(ConfigError, match="loss 'ppo': unknown aggregation 'token-sum'; valid: "
                                        "token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                                        "seq-mean-token-sum-norm"):
    losses.bind("ppo", {"aggregation": "token-sum"})
  with pytest.raises(ConfigError, match="loss 'cispo': norm_length=4096 is the normaliser of "
                                        "aggregation 'seq-mean-token-sum-norm', but the "
                                        "aggregation is 'token-mean'; bind aggregation="):
    losses.bind("cispo", {"norm_length": 4096})
  with pytest.raises(ConfigError, match="loss 'rloo': norm_length=-1 must be a positive"):
    losses.bind("rloo", {"aggregation": "seq-mean-token-sum-norm", "norm_length": -1})
  with pytest.raises(ConfigError, match="loss 'dr_grpo': norm_length='4k' must be a positive"):
    losses.bind("dr_grpo", {"norm_length": "4k"})
  losses.bind("dr_grpo", {"norm_length": 4096})  # its aggregation is that mode already


def test_values_only_the_trace_reads_fail_when_the_loss_is_bound():
  with pytest.raises(ConfigError, match="unknown KL estimator 'k4'"):
    losses.bind("grpo", {"kl_estimator": "k4"})
  with pytest.raises(ConfigError, match="k2.5 window must be 'log_ratio' or 'ratio'"):
    losses.bind("k2.5", {"window": "logratio"})
  losses.bind("grpo", {"kl_estimator": "k2"})


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


@pytest.mark.parametrize("name", losses.rollout_losses())
def test_train_step_is_invariant_to_micro_batching_and_packing(name, tiny_cfg, tiny_params):
  """The contract every registered loss meets: jit-able, finite, and the same update however
  the trajectories are split into micro-batches or arranged in packed rows."""
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 40, rng.integers(1, 5)).tolist() for _ in range(8)]
  completions = [rng.integers(3, 40, rng.integers(1, 9)).tolist() for _ in range(8)]
  logp = [rng.normal(-2, 0.5, len(c)).astype(np.float32) for c in completions]
  adv = rng.normal(size=8).tolist()
  keep = [True] * 7 + [False]
  # Teacher scores for the distillation loss (ignored by the others), its top-2 term on.
  fields = {"teacher_logp": [rng.normal(-2, 0.5, len(c)).astype(np.float32)
                             for c in completions]}
  hparams = {}
  if losses.get(name).teacher:
    fields["teacher_topk_ids"] = [rng.integers(3, 40, (len(c), 2)) for c in completions]
    fields["teacher_topk_logp"] = [rng.normal(-2, 0.5, (len(c), 2)) for c in completions]
    hparams = {"topk_coef": 0.5}
  optimizer = optax.sgd(0.1)
  loss_fn = losses.bind(name, hparams)
  results = []
  steps = {micro: make_train_step(tiny_cfg, optimizer, loss_fn, micro_batches=micro)
           for micro in (1, 4)}  # the permuted packing reuses the compiled micro=1 step
  for micro, order, row_multiple in ((1, range(8), 4), (4, range(8), 4),
                                     (1, [5, 2, 7, 0, 3, 6, 1, 4], 4)):
    pick = lambda xs: [xs[i] for i in order]
    batch, _ = trajectory_batch(pick(prompts), pick(completions), pick(logp), pick(adv),
                                pick(keep), seq_len=16, row_multiple=row_multiple,
                                token_fields={k: pick(v) for k, v in fields.items()})
    step = steps[micro]
    state, metrics = step(init_train_state(tiny_params, optimizer),
                          jax.tree.map(jnp.asarray, batch), tiny_params)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert "clip_fraction" in metrics and "ratio_mean" in metrics and "kl_to_old" in metrics
    results.append((state.params, float(metrics["loss"])))
  for params, loss in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, results[0][0])


def test_donated_train_step_equals_the_copying_one_and_deletes_its_input(tiny_cfg, tiny_params):
  rng = np.random.default_rng(1)
  prompts = [[1] + rng.integers(3, 40, 3).tolist() for _ in range(4)]
  completions = [rng.integers(3, 40, 6).tolist() for _ in range(4)]
  logp = [rng.normal(-2, 0.5, 6).astype(np.float32) for _ in range(4)]
  batch, _ = trajectory_batch(prompts, completions, logp, rng.normal(size=4).tolist(),
                              [True] * 4, seq_len=16, row_multiple=4)
  batch = jax.tree.map(jnp.asarray, batch)
  optimizer = optax.adamw(1e-2)
  loss_fn = losses.bind("grpo", {"kl_coef": 0.0})
  copying = make_train_step(tiny_cfg, optimizer, loss_fn)
  donating = make_train_step(tiny_cfg, optimizer, loss_fn, donate_state=True)
  want = copying(copying(init_train_state(tiny_params, optimizer), batch)[0], batch)[0]
  # A copy of the parameters: the state that is donated must not share tiny_params' buffers.
  state = init_train_state(jax.tree.map(jnp.copy, tiny_params), optimizer)
  first, _ = donating(state, batch)
  kernel = state.params["layers_0"]["mlp"]["up_proj"]["kernel"]
  assert kernel.is_deleted()
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(kernel)
  got, _ = donating(first, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               (got.params, got.opt_state), (want.params, want.opt_state))


# ----------------------------------------------------------------- the rest of the family

def _per_token(fn):
  """[(seg, advantage, [fn(lp, old, ref, adv) per masked token])] for the fixture batch."""
  out = []
  for seg, (adv, tokens) in zip((1, 2), _trajectories()):
    out.append((seg, adv, [fn(lp, old, ref, adv) for lp, old, ref in tokens]))
  return out


def _clip(x, lo, hi):
  return min(max(x, lo), hi)


def _ppo_token(eps_low, eps_high):
  def token(lp, old, ref, adv):
    ratio = math.exp(lp - old)
    return max(-adv * ratio, -adv * _clip(ratio, 1 - eps_low, 1 + eps_high))
  return token


def _loss(name, **hparams):
  weighted, metrics = losses.get(name).fn(jnp.asarray([LOGP]), _batch(), **hparams)
  return float(weighted.total / weighted.count), metrics


def test_ppo_and_dapo_match_hand_computation():
  for name, lo, hi in (("ppo", 0.2, 0.2), ("dapo", 0.2, 0.28)):
    tokens = [t for _, _, ts in _per_token(_ppo_token(lo, hi)) for t in ts]
    np.testing.assert_allclose(_loss(name)[0], sum(tokens) / len(tokens), rtol=1e-5)
  # Dual clip caps negative-advantage token losses at -c * A.
  capped = [min(t, 0.5 * 1.05) if adv < 0 else t
            for _, adv, ts in _per_token(_ppo_token(0.2, 0.2)) for t in ts]
  np.testing.assert_allclose(_loss("ppo", dual_clip=1.05)[0], sum(capped) / len(capped),
                             rtol=1e-5)


def test_dr_grpo_divides_token_sums_by_batch_and_max_length():
  sums = [sum(ts) for _, _, ts in _per_token(_ppo_token(0.2, 0.2))]
  np.testing.assert_allclose(_loss("dr_grpo", norm_length=100.0)[0], sum(sums) / (2 * 100),
                             rtol=1e-5)
  np.testing.assert_allclose(_loss("dr_grpo")[0], sum(sums) / (2 * 7), rtol=1e-5)  # row length


def test_gspo_matches_hand_computation():
  eps_low, eps_high = 3e-4, 4e-4
  per_seq = []
  for adv, tokens in _trajectories():
    s = math.exp(sum(lp - old for lp, old, _ in tokens) / len(tokens))
    per_seq.append(max(-adv * s, -adv * _clip(s, 1 - eps_low, 1 + eps_high)))
  np.testing.assert_allclose(_loss("gspo")[0], sum(per_seq) / 2, rtol=1e-5, atol=1e-8)


def test_cispo_matches_hand_computation_and_gradient_flows_through_logp_only():
  tokens = _per_token(lambda lp, old, ref, adv: (
      -_clip(math.exp(lp - old), 0.0, 1.2) * adv * lp, _clip(math.exp(lp - old), 0.0, 1.2) * adv))
  values = [v for _, _, ts in tokens for v, _ in ts]
  np.testing.assert_allclose(_loss("cispo")[0], sum(values) / len(values), rtol=1e-5)
  grad = jax.grad(lambda lp: losses.get("cispo").fn(lp, _batch())[0].total)(
      jnp.asarray([LOGP]))[0]
  expected = [-w for _, _, ts in tokens for _, w in ts]  # d/dlogp of -sg(w) A logp = -w A
  masked = [float(g) for g, m in zip(grad, MASK) if m]
  np.testing.assert_allclose(masked, expected, rtol=1e-5)
  assert all(e != 0 for e in expected)  # clipped tokens keep their gradient


def test_rloo_and_rest_match_hand_computation():
  seq_sums = [-adv * sum(lp for lp, _, _ in tokens) for adv, tokens in _trajectories()]
  np.testing.assert_allclose(_loss("rloo")[0], sum(seq_sums) / 2, rtol=1e-5)
  # ReST: only the positive-advantage trajectory (segment 1) counts, numerator and denominator.
  positive = [lp for adv, tokens in _trajectories() if adv > 0 for lp, _, _ in tokens]
  np.testing.assert_allclose(_loss("rest")[0], -sum(positive) / len(positive), rtol=1e-5)


def test_k25_matches_hand_computation_and_masks_gradient_outside_window():
  alpha, beta, tau = -0.15, 0.15, 0.1
  def token(lp, old, ref, adv):
    log_ratio = lp - old
    inside = alpha <= log_ratio <= beta
    return -(math.exp(log_ratio) * adv if inside else 0.0) + tau * log_ratio ** 2
  values = [t for _, _, ts in _per_token(token) for t in ts]
  np.testing.assert_allclose(_loss("k2.5", alpha=alpha, beta=beta, tau=tau)[0],
                             sum(values) / len(values), rtol=1e-5)
  grad = jax.grad(lambda lp: losses.get("k2.5").fn(lp, _batch(), alpha=alpha, beta=beta,
                                                     tau=0.0)[0].total)(jnp.asarray([LOGP]))[0]
  for t in range(7):
    log_ratio = LOGP[t] - OLD[t]
    if MASK[t] and not alpha <= log_ratio <= beta:
      assert float(grad[t]) == 0.0  # exactly zero outside, whatever the advantage's sign
    elif MASK[t]:
      assert float(grad[t]) != 0.0
  assert any(MASK[t] and not alpha <= LOGP[t] - OLD[t] <= beta for t in range(7))


def test_ppo_gradient_is_zero_where_clipped_in_the_advantages_direction():
  eps = 0.1
  grad = jax.grad(lambda lp: losses.get("ppo").fn(lp, _batch(), eps_low=eps, eps_high=eps)[
      0].total)(jnp.asarray([LOGP]))[0]
  clipped_seen = 0
  for t in range(7):
    if not MASK[t]:
      continue
    ratio = math.exp(LOGP[t] - OLD[t])
    clipped = (ADV[t] > 0 and ratio > 1 + eps) or (ADV[t] < 0 and ratio < 1 - eps)
    clipped_seen += clipped
    assert (float(grad[t]) == 0.0) == clipped, (t, ratio, ADV[t])
  assert clipped_seen >= 1


def test_leave_one_out_and_success_indicator():
  reward = jnp.asarray([1.0, 0.0, 0.0, 1.0, 0.7])
  groups = jnp.asarray([0, 0, 0, 1, 2])
  np.testing.assert_allclose(advantages.leave_one_out(reward, groups, 3),
                             [1.0, -0.5, -0.5, 1.0, 0.7], atol=1e-6)
  np.testing.assert_allclose(advantages.success_indicator(reward, groups, 3), [1, 0, 0, 1, 0])
