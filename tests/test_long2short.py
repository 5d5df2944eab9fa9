"""long2short: the selection rules on hand-made groups, the DPO loss against a hand
computation, pair packing, merging, and each method end to end on a tiny real model."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import config, transformer
from rl import checkpoint, long2short, losses, sft
from rl.packing import pair_batch
from rl.tasks.arithmetic import Arithmetic
from rl.train_step import init_train_state, make_train_step


def test_shortest_correct_picks_the_shortest_correct_one():
  assert long2short.shortest_correct([9, 4, 7, 3], [True, True, True, False]) == 1
  assert long2short.shortest_correct([5, 5, 8], [False, True, True]) == 1
  assert long2short.shortest_correct([5, 5], [True, True]) == 0  # the first among equals
  assert long2short.shortest_correct([5, 2, 8], [False, False, False]) is None
  assert long2short.shortest_correct([], []) is None


def test_dpo_pairs_follow_the_k15_rule():
  #            0      1     2      3     4      5      6
  lengths = [10, 4, 6, 3, 5, 4, 12]
  correct = [True, True, False, False, True, False, True]
  # chosen: 1 (shortest correct, 4 tokens). Incorrect and longer: 2 (6). Incorrect but shorter
  # or as long: 3 (3), 5 (4) are not negatives. Correct and >= 1.5 x 4 = 6 tokens: 0 (10),
  # 6 (12); 4 (5 tokens) is not.
  assert long2short.dpo_pairs(lengths, correct) == [(1, 0), (1, 2), (1, 6)]
  assert long2short.dpo_pairs([4, 6], [True, True]) == [(0, 1)]  # exactly 1.5x counts
  assert long2short.dpo_pairs([4, 5], [True, True], ratio=1.25) == [(0, 1)]
  assert long2short.dpo_pairs([4, 5], [True, True]) == []
  assert long2short.dpo_pairs([3, 8, 9], [False, False, False]) == []


def test_group_helpers_over_scored_samples(tokenizer):
  from rl.trajectory import Trajectory

  def trajectory(prompt, n, right):
    return Trajectory({}, tuple(prompt), token_ids=list(range(3, n + 3)), logprobs=[0.0] * n,
                      versions=[0] * n, policy_mask=[True] * n, policy_count=n, finish="stop",
                      correct=right, well_formed=True)
  lengths = [5, 3, 7, 2, 4, 6]
  correct = np.array([True, True, False, False, False, False])
  scored = [trajectory([1, 2] if i < 3 else [1, 9], n, right)
            for i, (n, right) in enumerate(zip(lengths, correct))]
  examples = long2short.shortest_rejection_examples(scored, samples=3)
  assert len(examples) == 1  # the second prompt has no correct completion
  assert list(examples[0][0]) == [1, 2] and len(examples[0][1]) == 3
  prompts, chosen, rejected = long2short.preference_pairs(scored, samples=3)
  assert [len(c) for c in chosen] == [3, 3] and [len(r) for r in rejected] == [5, 7]
  with pytest.raises(ValueError, match="groups of 4"):
    long2short.shortest_rejection_examples(scored, samples=4)


def test_pair_batch_keeps_each_pair_in_one_row():
  prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
  chosen = [[11, 2], [12, 13, 2], [14, 2]]
  rejected = [[15, 16, 17, 2], [18, 2], [19, 20, 2]]
  batch, placements = pair_batch(prompts, chosen, rejected, seq_len=16, row_multiple=4)
  assert batch.tokens.shape == (4, 16)
  for (row, start), p, c, r in zip(placements, prompts, chosen, rejected):
    n_c, n_r = len(p) + len(c) - 1, len(p) + len(r) - 1
    seg = batch.segment_ids[row, start]
    assert seg % 2 == 1 and (batch.segment_ids[row, start:start + n_c] == seg).all()
    assert (batch.segment_ids[row, start + n_c:start + n_c + n_r] == seg + 1).all()
    np.testing.assert_array_equal(batch.tokens[row, start:start + n_c], (p + c)[:-1])
    np.testing.assert_array_equal(batch.targets[row, start + n_c:start + n_c + n_r], (p + r)[1:])
    np.testing.assert_array_equal(batch.positions[row, start + n_c:start + n_c + n_r],
                                  np.arange(n_r))
    # The loss covers the completions' targets only.
    assert batch.loss_mask[row, start:start + n_c].sum() == len(c)
    assert batch.loss_mask[row, start + n_c:start + n_c + n_r].sum() == len(r)


def test_dpo_loss_equals_a_hand_computation():
  prompts = [[1, 5], [1, 6, 7]]
  chosen = [[8, 2], [9, 2]]
  rejected = [[10, 11, 2], [12, 2]]
  batch, placements = pair_batch(prompts, chosen, rejected, seq_len=32)
  rng = np.random.default_rng(0)
  logp = rng.normal(-2.0, 0.7, batch.tokens.shape).astype(np.float32)
  ref = rng.normal(-2.0, 0.7, batch.tokens.shape).astype(np.float32)
  beta = 0.3
  expected = []
  for (row, start), p, c, r in zip(placements, prompts, chosen, rejected):
    n_c, n_r = len(p) + len(c) - 1, len(p) + len(r) - 1
    # completion targets are the last len(c) (resp. len(r)) positions of each half
    d_c = sum(logp[row, t] - ref[row, t] for t in range(start + n_c - len(c), start + n_c))
    end = start + n_c + n_r
    d_r = sum(logp[row, t] - ref[row, t] for t in range(end - len(r), end))
    expected.append(-math.log(1.0 / (1.0 + math.exp(-beta * (d_c - d_r)))))
  batch = jax.tree.map(jnp.asarray, batch).replace(ref_logp=jnp.asarray(ref))
  weighted, metrics = losses.get("dpo").fn(jnp.asarray(logp), batch, beta=beta)
  assert float(weighted.count) == 2
  np.testing.assert_allclose(float(weighted.total / weighted.count), np.mean(expected),
                             rtol=1e-5)
  assert "reward_accuracy" in metrics and "reward_margin" in metrics
  with pytest.raises(ValueError, match="reference log-probs"):
    losses.get("dpo").fn(jnp.asarray(logp), batch.replace(ref_logp=None))


def test_dpo_is_not_an_rl_loss_and_its_step_ignores_micro_batching(tiny_cfg, tiny_params):
  assert "dpo" in losses.LOSSES and "dpo" not in losses.rollout_losses()
  rng = np.random.default_rng(1)
  prompts = [[1] + rng.integers(3, 40, rng.integers(1, 4)).tolist() for _ in range(6)]
  chosen = [rng.integers(3, 40, rng.integers(1, 4)).tolist() + [2] for _ in range(6)]
  rejected = [rng.integers(3, 40, rng.integers(2, 6)).tolist() + [2] for _ in range(6)]
  optimizer = optax.sgd(0.1)
  results = []
  for micro in (1, 2):
    batch, _ = pair_batch(prompts, chosen, rejected, seq_len=16, row_multiple=4)
    step = make_train_step(tiny_cfg, optimizer, losses.bind("dpo"), micro_batches=micro)
    state, metrics = step(init_train_state(tiny_params, optimizer),
                          jax.tree.map(jnp.asarray, batch), tiny_params)
    # Policy = reference at the start: every margin is 0, the loss log 2.
    np.testing.assert_allclose(float(metrics["loss"]), math.log(2.0), rtol=1e-5)
    results.append(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *results)


def test_merge_ratio_zero_and_one_return_each_model_exactly(tiny_cfg):
  a = transformer.init_params(tiny_cfg, jax.random.PRNGKey(1))
  b = transformer.init_params(tiny_cfg, jax.random.PRNGKey(2))
  same = lambda x, y: jax.tree.map(lambda u, v: np.testing.assert_array_equal(u, v), x, y)
  same(long2short.merge(a, b, 0.0), a)
  same(long2short.merge(a, b, 1.0), b)
  half = long2short.merge(a, b, 0.5)
  jax.tree.map(lambda h, u, v: np.testing.assert_allclose(h, (u + v) / 2, rtol=1e-6), half, a, b)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), a)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(long2short.merge(bf16, bf16, 0.3)))
  with pytest.raises(ValueError, match="ratio"):
    long2short.merge(a, b, 1.5)
  with pytest.raises(ValueError, match="trees"):
    long2short.merge(a, {"x": 1}, 0.5)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, tokenizer):
  """A tiny model SFT'd on filler-padded addition, saved as a run directory."""
  factory = lambda vocab: config.tiny(vocab, hidden_size=32, num_layers=2, num_heads=4,
                                      num_kv_heads=2, intermediate_size=64)
  task = Arithmetic(digits=1, operands=2, filler=3, num_train=256, num_test=64)
  cfg = factory(tokenizer.vocab_size)
  params, _ = sft.warm_start(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg, task,
                             tokenizer, steps=400, batch_size=32, seq_len=32, progress=False)
  run_dir = str(tmp_path_factory.mktemp("long"))
  checkpoint.save_policy(run_dir, params)
  return run_dir, factory, task, params


def test_each_method_end_to_end(long_run, tmp_path):
  run_dir, factory, task, long_params = long_run
  sizes = long2short.Long2ShortConfig(num_prompts=24, samples=4, max_new_tokens=32, steps=12,
                                      batch_size=8, eval_records=8, seq_len=48)
  common = dict(long_run=run_dir, model=factory, task=task, sizes=sizes, progress=False)
  short = long2short.run(str(tmp_path / "sft"), method="shortest_rejection", **common)
  assert short["examples"] > 0 and short["example_length"] <= short["sample_correct_length"]
  pref = long2short.run(str(tmp_path / "dpo"), method="dpo",
                        **{**common, "sizes": dataclasses.replace(sizes, learning_rate=1e-3)})
  assert pref["pairs"] > 0
  # 12 DPO updates on these pairs: the policy prefers the chosen completions.
  assert pref["dpo_reward_accuracy"] > 0.5 and pref["dpo_loss"] < math.log(2.0)
  merged = long2short.run(str(tmp_path / "merge"), method="merge",
                          merge_with=str(tmp_path / "sft"),
                          **{**common, "sizes": dataclasses.replace(sizes, merge_ratio=1.0)})
  # ratio 1: exactly the short model, so the same greedy evaluation.
  assert (merged["accuracy"], merged["length"]) == (short["accuracy"], short["length"])
  for name in ("sft", "dpo", "merge"):
    saved = json.load(open(tmp_path / name / "summary.json"))
    assert {"accuracy", "length", "long_accuracy", "long_length"} <= set(saved)
  like = jax.eval_shape(lambda: long_params)
  restored = checkpoint.load_policy(str(tmp_path / "merge"), like=like)
  jax.tree.map(np.testing.assert_array_equal, restored,
               checkpoint.load_policy(str(tmp_path / "sft"), like=like))
  with pytest.raises(ValueError, match="method"):
    long2short.run(str(tmp_path / "x"), method="distill", **common)
  with pytest.raises(ValueError, match="merge_with"):
    long2short.run(str(tmp_path / "x"), method="merge", **common)
  assert not os.path.exists(tmp_path / "x")


def test_init_from_errors_name_the_problem(long_run, tmp_path, tokenizer):
  from rl import ConfigError, trainer
  from rl.config import RLConfig
  run_dir, factory, task, long_params = long_run
  with pytest.raises(ConfigError, match="init_from.*no checkpoints"):
    trainer.train(str(tmp_path / "run"), task=task, model=factory,
                  start=trainer.FromRun(str(tmp_path / "missing")),
                  hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=8), progress=False),
                  rl=RLConfig(prompts_per_step=4))
  bigger = config.tiny(tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, intermediate_size=64)
  like = jax.eval_shape(lambda: transformer.init_params(bigger, jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match="do not fit this model config"):
    checkpoint.load_policy(run_dir, like=like)
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    checkpoint.load_policy(str(tmp_path))
