"""The off-policy correction menu (rl/corrections.py) on a hand-made packed batch: each
correction weights or masks exactly the tokens its definition says."""

import numpy as np
import pytest

from rl import ConfigError, corrections
from rl.types import TrainBatch

# Two rows, three trajectories: A = row 0 segment 1 (loss tokens at 1, 2), B = row 0 segment 2
# (loss token at 4), C = row 1 segment 1 (loss tokens at 1, 2, 3). d = trainer - engine
# log-prob of each loss token: A (0.5, 0.5), sum 1; B (-1.0); C (0.1, -0.2, 0.1), sum 0.
SEGMENTS = [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
LOSS_MASK = [[0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0]]
D = [[0, 0.5, 0.5, 0, -1.0, 0], [0, 0.1, -0.2, 0.1, 0, 0]]
A, B, C = [(0, 1), (0, 2)], [(0, 4)], [(1, 1), (1, 2), (1, 3)]


def _batch():
  shape = (2, 6)
  engine = np.full(shape, -2.0, np.float32)
  batch = TrainBatch(tokens=np.ones(shape, np.int32), targets=np.ones(shape, np.int32),
                     positions=np.zeros(shape, np.int32),
                     segment_ids=np.asarray(SEGMENTS, np.int32),
                     loss_mask=np.asarray(LOSS_MASK, np.float32), old_logp=engine,
                     advantages=np.full(shape, 3.0, np.float32))
  return batch, (engine + np.asarray(D)).astype(np.float32)


def _at(x, tokens):
  return np.array([x[r, t] for r, t in tokens])


def _dropped(out, batch):
  return {(int(r), int(t)) for r, t in zip(*np.nonzero((batch.loss_mask > 0)
                                                       & (out.loss_mask == 0)))}


def test_sequence_tis_weighs_each_trajectory_by_its_capped_ratio_product():
  batch, trainer = _batch()
  out, metrics = corrections.seq_tis(cap=2.0).apply(batch, step=0, trainer_logp=trainer)
  np.testing.assert_allclose(_at(out.advantages, A), [3.0 * 2.0] * 2)  # e^1 capped at 2
  np.testing.assert_allclose(_at(out.advantages, B), [3.0 * np.exp(-1.0)], rtol=1e-6)
  np.testing.assert_allclose(_at(out.advantages, C), [3.0] * 3, rtol=1e-6)  # e^0
  np.testing.assert_array_equal(out.old_logp, trainer)
  assert not _dropped(out, batch)
  assert metrics == {}  # it drops nothing; the loop logs the mismatch (measure)


@pytest.mark.parametrize("make,dropped,masked_key", [
    (lambda: corrections.mis(high=1.5), set(A), "mis_masked"),
    (lambda: corrections.mis(level="sequence"), set(A), "seq_mis_masked"),
    (lambda: corrections.icepop(), set(B), "icepop_masked"),
    (lambda: corrections.mis(low=0.85, high=5.0), set(B) | {(1, 2)}, "mis_masked")])
def test_masked_importance_sampling_drops_what_leaves_the_window_and_weighs_the_rest(
    make, dropped, masked_key):
  batch, trainer = _batch()
  correction = make()
  out, metrics = correction.apply(batch, step=0, trainer_logp=trainer)
  assert _dropped(out, batch) == dropped
  assert metrics[masked_key] == pytest.approx(len(dropped) / 6)
  level_sequence = correction.name == "seq_mis"
  ratio = np.exp(np.asarray(D))
  if level_sequence:  # one ratio per trajectory: the product over its tokens
    for tokens, total in ((A, 1.0), (B, -1.0), (C, 0.0)):
      for r, t in tokens:
        ratio[r, t] = np.exp(total)
  for r, t in set(A + B + C) - dropped:
    assert out.advantages[r, t] == pytest.approx(3.0 * ratio[r, t], rel=1e-6)
  np.testing.assert_array_equal(out.old_logp, trainer)


def test_geometric_mean_mask_drops_whole_trajectories_and_keeps_the_engine_log_probs():
  batch, trainer = _batch()
  # Geometric means: A e^0.5, B e^-1, C e^0.
  out, metrics = corrections.geo_mask(low=0.9, high=1.1).apply(batch, step=0,
                                                                trainer_logp=trainer)
  assert _dropped(out, batch) == set(A) | set(B)
  assert metrics["geo_mask_masked"] == pytest.approx(3 / 6)
  np.testing.assert_array_equal(out.old_logp, batch.old_logp)
  np.testing.assert_array_equal(out.advantages, batch.advantages)
  out, _ = corrections.geo_mask(low=0.3, high=1.7).apply(batch, step=0, trainer_logp=trainer)
  assert not _dropped(out, batch)


def test_measure_logs_the_mismatch_and_what_each_mask_would_drop():
  batch, trainer = _batch()
  metrics = corrections.measure(batch, trainer)
  d = np.array([0.5, 0.5, -1.0, 0.1, -0.2, 0.1])
  assert metrics["engine_logp_diff_max"] == pytest.approx(1.0)
  assert metrics["engine_kl_k1"] == pytest.approx(-d.mean(), abs=1e-6)
  assert metrics["engine_kl_k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-5)
  assert metrics["engine_ratio_p01"] == pytest.approx(np.exp(np.percentile(d, 1)), rel=1e-5)
  assert metrics["engine_ratio_p99"] == pytest.approx(np.exp(np.percentile(d, 99)), rel=1e-5)
  # At their defaults: trust_region (-1, 1) keeps d = -1.0; mis [0, 2] drops no token;
  # icepop [0.5, 5] drops B; geo_mask [0.9, 1.1] drops A and B; seq_mis [0, 2] drops A.
  assert {k: v for k, v in metrics.items() if k.startswith("would_mask_")} == pytest.approx(
      {"would_mask_trust_region": 0.0, "would_mask_mis": 0.0, "would_mask_icepop": 1 / 6,
       "would_mask_geo_mask": 3 / 6, "would_mask_seq_mis": 2 / 6})


@pytest.mark.parametrize("make,message", [
    (lambda: corrections.seq_tis(cap=0.0), "seq_tis: cap=0.0 must be > 0"),
    (lambda: corrections.mis(level="row"), "level='row' must be 'token' or 'sequence'"),
    (lambda: corrections.mis(low=1.2, high=2.0), "must hold ratio 1"),
    (lambda: corrections.icepop(low=0.5, high=0.9), "icepop: .* must hold ratio 1"),
    (lambda: corrections.geo_mask(low=0.0), "geo_mask: .* must hold ratio 1")])
def test_a_correction_outside_its_domain_says_so(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


def test_every_correction_is_registered_under_its_name():
  for name, make in corrections.CORRECTIONS.items():
    assert make().name == name
