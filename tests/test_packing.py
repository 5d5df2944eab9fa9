"""Packing places every trajectory whole, and unpacking gives it back."""

import numpy as np
import pytest

from rl.packing import pack, trajectory_batch, unpack


def test_pack_unpack_round_trip():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 17, 40)
  seqs = [{"tokens": rng.integers(1, 100, n).astype(np.int32),
           "values": rng.normal(size=n).astype(np.float32)} for n in lengths]
  fields, placements = pack(seqs, seq_len=16, row_multiple=4)
  rows = fields["tokens"].shape[0]
  assert rows % 4 == 0 and fields["tokens"].shape[1] == 16
  assert rows * 16 < 2 * lengths.sum() + 4 * 16  # first-fit decreasing packs densely
  for key in ("tokens", "values"):
    for seq, got in zip(seqs, unpack(fields[key], placements, lengths)):
      np.testing.assert_array_equal(got, seq[key])
  for (row, start), n in zip(placements, lengths):
    segment = fields["segment_ids"][row, start:start + n]
    assert segment.min() == segment.max() > 0  # one segment id, never padding
    np.testing.assert_array_equal(fields["positions"][row, start:start + n], np.arange(n))
  # Every placed token is covered by exactly one trajectory; the rest is padding.
  assert (fields["segment_ids"] > 0).sum() == lengths.sum()


def test_pack_rejects_a_sequence_longer_than_a_row():
  with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than seq_len=8"):
    pack([{"t": np.zeros(3)}, {"t": np.zeros(9)}], seq_len=8)


def test_trajectory_batch_aligns_targets_and_masks():
  batch, placements = trajectory_batch(
      prompts=[[1, 10, 11], [1, 12]], completions=[[20, 21, 2], [22]],
      completion_logp=[np.array([-0.1, -0.2, -0.3]), np.array([-0.4])], advantages=[0.5, -1.0],
      train_mask=[True, False], seq_len=8)
  (row, start), n = placements[0], 5
  np.testing.assert_array_equal(batch.tokens[row, start:start + n], [1, 10, 11, 20, 21])
  np.testing.assert_array_equal(batch.targets[row, start:start + n], [10, 11, 20, 21, 2])
  np.testing.assert_array_equal(batch.loss_mask[row, start:start + n], [0, 0, 1, 1, 1])
  np.testing.assert_allclose(batch.old_logp[row, start:start + n], [0, 0, -0.1, -0.2, -0.3])
  np.testing.assert_allclose(batch.advantages[row, start:start + n], [0.5] * 5)
  (row, start), n = placements[1], 2
  np.testing.assert_array_equal(batch.targets[row, start:start + n], [12, 22])
  np.testing.assert_array_equal(batch.loss_mask[row, start:start + n], [0, 0])  # masked out

