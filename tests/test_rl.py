"""The RL loop end to end on tiny real models: it learns, it resumes exactly."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config, transformer
from rl import ConfigError, corrections, distill, loop, losses, rewards, sampling, sft, sources, trainer
from rl.checkpoint import Checkpointer
from rl.config import KLReward, RLConfig
from rl.tasks.arithmetic import Arithmetic
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rollouts.jax_engine import JaxEngine
from rollouts.sglang_engine import local_engine
from tests import helpers


class PickADigit:
  """SFT teaches "answer with one digit"; RL rewards only the digit 7."""

  def __init__(self, num_records):
    self.train = [{"digit": str(i % 10)} for i in range(num_records)]
    self.test = self.train

  def prompt(self, record):
    return "pick:"

  def solution(self, record):
    return record["digit"]

  def verify(self, completion, record):
    return completion == "7"

  def well_formed(self, completion):
    return len(completion) == 1 and completion.isdigit()


class Hopeless(PickADigit):
  """No completion is ever right: every group is all wrong."""

  def verify(self, completion, record):
    return False


@pytest.fixture(scope="module")
def digit_model(tokenizer):
  """A tiny model SFT'd to answer "pick:" with one digit, uniformly: reward 7 is ~10%."""
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=64)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  params, _ = sft.warm_start(params, cfg, PickADigit(10), tokenizer, steps=150, batch_size=32,
                             seq_len=16, progress=False)
  return cfg, params


@pytest.fixture(scope="module")
def seven_teacher(tokenizer, digit_model):
  """For the distillation loss: a teacher SFT'd to always answer 7 (the rewarded digit)."""
  cfg, params = digit_model
  sevens = PickADigit(10)
  sevens.train = [{"digit": "7"}] * 10
  params, _ = sft.warm_start(params, cfg, sevens, tokenizer, steps=100, batch_size=32,
                             seq_len=16, progress=False)
  return distill.Teachers({"seven": JaxEngine(cfg, params)}, {"*": "seven"})


@pytest.mark.parametrize("name", losses.rollout_losses())
def test_rl_on_a_single_prompt_drives_reward_to_one(name, tokenizer, digit_model, request):
  """Every rollout loss learns to pick 7; the distillation loss (reward_weight 0: it never
  sees the reward) by matching a teacher that picks 7."""
  cfg, params = digit_model
  teachers = request.getfixturevalue("seven_teacher") if losses.get(name).teacher else None
  steps, _ = helpers.steps(
      params, cfg, engine=JaxEngine(cfg, params), task=PickADigit(1), tokenizer=tokenizer,
      loss=name, config=RLConfig(prompts_per_step=1, samples_per_prompt=32, max_new_tokens=4,
                                 seq_len=16, learning_rate=2e-3),
      ref_params=params,  # used by losses with a KL to the reference
      teachers=teachers)
  history = [next(steps).metrics["reward"] for _ in range(60)]
  assert history[0] < 0.5
  assert max(history) == 1.0, history
  assert np.mean(history[-10:]) >= 0.9, history


def test_donating_train_step_in_the_loop_equals_the_copying_one(tokenizer, digit_model):
  """train() donates the state to its train step. With truncated importance sampling over
  two minibatches (old log-probs from the step's starting params for both) and a KL to the
  reference, two RL steps give the same states and metrics either way; the donated run
  really updates in place (the first step's state is deleted by the second)."""
  cfg, params = digit_model
  rl = RLConfig(prompts_per_step=2, samples_per_prompt=8, max_new_tokens=4, seq_len=16,
                minibatches=2, learning_rate=2e-3)

  def two_steps(donate):
    # Copies: a donated state must not share the fixture's buffers.
    start = jax.tree.map(jnp.copy, params)
    steps, _ = helpers.steps(start, cfg, engine=JaxEngine(cfg, start), task=PickADigit(2),
                             tokenizer=tokenizer, loss="grpo", config=rl,
                             correction=corrections.tis(), donate=donate, ref_params=params)
    first = next(steps)
    kernel = first.state.train.params["layers_0"]["mlp"]["up_proj"]["kernel"]
    second = next(steps)
    return kernel.is_deleted(), [first.metrics, second.metrics], second.state.train

  copied_deleted, copied_metrics, copied = two_steps(False)
  donated_deleted, donated_metrics, donated = two_steps(True)
  assert donated_deleted and not copied_deleted
  assert copied.step == donated.step == 4  # two minibatches per RL step
  for a, b in zip(copied_metrics, donated_metrics):
    assert a.keys() == b.keys()
    for key in a:
      if not key.endswith("_s"):  # wall-clock seconds
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-7, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7),
               (copied.params, copied.opt_state), (donated.params, donated.opt_state))


def test_the_correction_menu_in_the_loop(tokenizer, digit_model):
  """One RL step each, the engine an older policy than the trainer's (its params perturbed):
  every correction's step logs the same mismatch of the same rollouts and what each mask would
  drop (keep's too: the metrics-only mode); icepop masks the tokens whose ratio leaves [0.5,
  5] and seq_tis reweights whole trajectories, so each updates the params otherwise than keep
  does. With the engine on the trainer's own params there is nothing to correct: icepop masks
  nothing and updates as keep does (tests/test_corrections.py has their arithmetic on a
  hand-made batch)."""
  cfg, params = digit_model
  rl = RLConfig(prompts_per_step=2, samples_per_prompt=8, max_new_tokens=4, seq_len=16)
  noise = jax.tree.map(lambda x: 0.5 * jnp.std(x) * jax.random.normal(
      jax.random.PRNGKey(1), x.shape, x.dtype), params)
  older = jax.tree.map(lambda x, n: x + n, params, noise)

  def one_step(correction, engine_params):
    steps, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, engine_params),
                             task=PickADigit(2), tokenizer=tokenizer, loss="k1.5", config=rl,
                             correction=correction)
    record = next(steps)
    return record.metrics, record.state.train.params

  made = {c.name: one_step(c, older) for c in (corrections.keep(), corrections.icepop(),
                                               corrections.seq_tis())}
  metrics = {name: m for name, (m, _) in made.items()}
  for name, step in metrics.items():
    for key in ("engine_kl_k3", "engine_ratio_p99", "would_mask_icepop", "would_mask_geo_mask",
                "loss"):
      assert np.isfinite(step[key]), (name, key)
    # The same rollouts (same seed) under each: the same mismatch, and a real one.
    assert step["engine_kl_k3"] == metrics["keep"]["engine_kl_k3"] > 1e-3, name
  assert metrics["keep"]["reward"] > 0.0  # some advantages are not 0
  assert 0.0 < metrics["icepop"]["icepop_masked"] == metrics["keep"]["would_mask_icepop"] < 1.0

  def moved(a, b):  # the largest difference between two param trees
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))

  for name in ("icepop", "seq_tis"):
    assert moved(made[name][1], made["keep"][1]) > 1e-4, name
  same, kept = one_step(corrections.icepop(), params), one_step(corrections.keep(), params)
  assert same[0]["icepop_masked"] == 0.0
  assert moved(same[1], kept[1]) < 1e-6 < moved(kept[1], params)


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["partial"])
def test_rl_through_the_server_drives_reward_to_one(rollout, tokenizer, digit_model, tmp_path):
  """The same learning as in-process, with rollouts from a server process over SGLang's
  protocol (weights synced from disk every step), whole or as partial rollouts."""
  cfg, params = digit_model
  rl = RLConfig(prompts_per_step=1, samples_per_prompt=32, max_new_tokens=4, seq_len=16,
                learning_rate=2e-3)
  partial = rollout == "partial"
  # 8 requests in flight (a server decodes 8 at once): once the budget is spent, the ones not yet sent wait for the
  # next iteration (aborted mid-generation ones are tested in test_sglang.py).
  engine = local_engine(cfg, params, 0, weights_dir=str(tmp_path), max_batch=8)
  try:
    steps, _ = helpers.steps(
        params, cfg, engine=engine, task=PickADigit(1), tokenizer=tokenizer, config=rl,
        rollouts=sources.Partial(token_budget=40) if partial else sources.Lockstep(),
        correction=corrections.tis() if partial else corrections.keep())
    records = [next(steps) for _ in range(60)]
  finally:
    engine.close()
  history = [r.metrics["reward"] for r in records]
  assert history[0] < 0.5
  assert np.mean(history[-10:]) >= 0.9, history
  assert all(r.metrics["weight_sync_s"] > 0 for r in records)
  assert engine.version == 60
  assert max(r.metrics["engine_logp_diff_max"] for r in records[:1]) < 1e-4
  if rollout == "partial":
    assert sum(r.metrics["partial_aborted"] for r in records) > 0
    assert max(r.metrics["partial_iterations"] for r in records) > 1


TINY_RL = RLConfig(prompts_per_step=4, samples_per_prompt=4, minibatches=2, max_new_tokens=16,
                   seq_len=32)


def _tiny_run(run_dir, num_steps, *, rl=TINY_RL, **overrides):
  kwargs = dict(
      task=Arithmetic(digits=1, num_train=500, num_test=50),
      model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
      rl=dataclasses.replace(rl, num_steps=num_steps),
      start=trainer.WarmStart(steps=5, batch_size=16),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), checkpoint_every=2,
                          progress=False))
  kwargs.update(overrides)
  return trainer.train(run_dir, **kwargs)


def _params_at(run_dir, step, vocab_size=55):
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
  cfg = config.tiny(vocab_size, hidden_size=32, intermediate_size=64)
  like_parts = helpers.parts(cfg, engine=None, task=Arithmetic(digits=1, num_train=500),
                             tokenizer=None, config=TINY_RL)
  like = loop.init_state(transformer.init_params(cfg, jax.random.PRNGKey(0)),
                         loop.rl_optimizer(1e-4), like_parts, 0)
  state = ckpt.restore(like, step=step)
  ckpt.close()
  return state


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(tmp_path, capsys):
  whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
  summary = _tiny_run(whole, 4)
  _tiny_run(split, 2)
  assert "resuming" not in capsys.readouterr().out
  resumed = _tiny_run(split, 4)
  out = capsys.readouterr().out
  assert "resuming from" in out and "at RL step 2" in out
  assert "SFT" not in out.split("resuming")[1]  # nothing retrained
  assert summary["sft_accuracy"] == resumed["sft_accuracy"]
  a, b = _params_at(whole, 4), _params_at(split, 4)
  assert int(a.step) == int(b.step) == 4
  assert int(a.train.step) == int(b.train.step) == 8  # 2 minibatches per RL step
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  steps = [json.loads(line)["step"] for line in open(os.path.join(split, "metrics.jsonl"))]
  assert steps == [0, 1, 2, 3, 4]  # appended, not overwritten (0: the eval after SFT)
  assert os.path.exists(os.path.join(split, "metrics.png"))


def test_resuming_a_checkpoint_of_another_layout_names_what_differs(tmp_path):
  """A run directory written by the loop before the redesign (or with another source) is
  refused with what differs and how to start from its params; its checkpoint stays."""
  directory = str(tmp_path / "checkpoints")
  old = {"train": {"params": {"w": np.ones(3, np.float32)}}, "replay": {"tokens": np.zeros(2)},
         "next_group": np.int32(0)}
  ckpt = Checkpointer(directory)
  ckpt.save(7, old)
  ckpt.close()
  ckpt = Checkpointer(directory)
  like = {"train": {"params": {"w": np.zeros(3, np.float32)}}, "rollout": {"rng": np.zeros(2)}}
  with pytest.raises(ValueError, match=r"checkpoints/7 holds a loop state of another layout.*"
                     r"only in the checkpoint: \['next_group', 'replay'\]; only in this run: "
                     r"\['rollout'\].*FromRun"):
    ckpt.restore(like)
  np.testing.assert_array_equal(ckpt.restore_params()["w"], np.ones(3))  # nothing lost
  ckpt.close()


class GivenParams:
  """A start of one's own (rl.trainer.Start): the run begins from `given`, also its reference
  policy, held in memory; `calls` records what the trainer asked of it."""

  def __init__(self, given, fail: bool = False):
    self.given, self.fail, self.calls = given, fail, []

  def check(self, tokenizer, processes: int) -> None:
    self.calls.append("check")

  def initial(self, cfg, mesh, seed: int):
    return self.given

  def params(self, initial, cfg, task, tokenizer, **_):
    if self.fail:
      raise RuntimeError("no params today")
    return initial, {"sft_loss": None, "init_from": "memory"}

  def keep(self, run_dir: str, params) -> None:
    self.calls.append("keep")

  def reference(self, run_dir: str, like):
    self.calls.append("reference")
    return self.given


def test_a_start_of_ones_own_begins_the_run_and_one_stack_cleans_up(tmp_path, capsys,
                                                                    tokenizer):
  """rl.trainer.Start is a protocol: a class with its methods starts a run and is asked for
  the reference of a loss with a KL. A build that fails midway (here in the start's params)
  releases what it acquired, the run directory's hold included: the next build on that
  directory goes ahead; a run closed twice closes once."""
  model = lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64)
  given = transformer.init_params(model(tokenizer.vocab_size), jax.random.PRNGKey(3))
  kwargs = dict(task=Arithmetic(digits=1, num_train=50, num_test=8), model=model,
                rl=dataclasses.replace(TINY_RL, num_steps=1),
                objective=trainer.Objective(loss="grpo"),
                hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=8), progress=False,
                                    tensorboard=False))
  run_dir = str(tmp_path / "run")
  with pytest.raises(RuntimeError, match="no params today"):
    trainer.build(run_dir, start=GivenParams(given, fail=True), **kwargs)
  start = GivenParams(given)
  run = trainer.build(run_dir, start=start, **kwargs)
  try:
    jax.tree.map(np.testing.assert_array_equal, run.state.train.params, given)
  finally:
    run.close()
    run.close()
  assert start.calls == ["check", "keep", "reference"], start.calls
  assert "starting from the params of memory (no SFT warm start)" in capsys.readouterr().out


def test_demonstrations_without_a_chat_template_are_refused_before_anything_is_written(
    tmp_path):
  demonstrations = tmp_path / "sft.jsonl"
  demonstrations.write_text('{"messages": []}\n')
  with pytest.raises(ConfigError, match="WarmStart.demonstrations are chat conversations"):
    trainer.build(str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=50, num_test=8),
                  model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
                  start=trainer.WarmStart(demonstrations=str(demonstrations)))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_kl_in_the_reward_runs_in_train(tmp_path):
  summary = _tiny_run(str(tmp_path / "klr"), 2, rl=RLConfig(
      prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16, seq_len=32),
      objective=trainer.Objective(kl_reward=KLReward(coef=0.05)))
  assert summary["steps"] == 2


@pytest.mark.slow
def test_kl_reference_is_the_sft_model(tmp_path):
  assert losses.uses_reference("grpo") and not losses.uses_reference("grpo", {"kl_coef": 0.0})
  assert not losses.uses_reference("k1.5")
  run = str(tmp_path / "grpo")
  # kl_coef = 0.04 by default: the SFT model is the reference
  _tiny_run(run, 2, objective=trainer.Objective(loss="grpo"))
  sft_state = _params_at(run, 0)
  saved = Checkpointer(os.path.join(run, "sft"))
  params = saved.restore(sft_state.train.params)
  saved.close()
  jax.tree.map(np.testing.assert_array_equal, params, sft_state.train.params)
  records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  assert all(r["kl"] >= 0 for r in records[1:])


def test_dynamic_sampling_never_yields_an_all_equal_group(tokenizer, digit_model):
  cfg, params = digit_model
  config_ = RLConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=4, seq_len=16)
  steps, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, params), task=PickADigit(10),
                           tokenizer=tokenizer, loss="dapo", config=config_,
                           rollouts=sources.DynamicSampling(max_rounds=30))
  rounds = 0
  for _ in range(3):
    record = next(steps)
    groups = record.rewards.reshape(4, 4)
    assert (groups.std(axis=1) > 0).all()
    assert len(record.trajectories) == 16
    rounds += record.metrics["generation_rounds"]
    # Every generated group is counted in the prompt statistics, kept or not.
    assert int(record.state.rollout.prompt_stats.attempts.sum()) >= 16 * record.metrics[
        "generation_rounds"]
  assert rounds > 3  # uniform groups were met and dropped
  # A task where every group is uniform exhausts the rounds with a clear error.
  hopeless, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, params), task=Hopeless(10),
                              tokenizer=tokenizer, loss="dapo", config=config_,
                              rollouts=sources.DynamicSampling(max_rounds=30))
  with pytest.raises(RuntimeError, match="dynamic sampling: fewer than 4 groups"):
    next(hopeless)


def test_kl_in_the_reward_subtracts_the_sequence_kl(tokenizer, digit_model):
  cfg, params = digit_model
  other = transformer.init_params(cfg, jax.random.PRNGKey(5))  # a reference far from params
  reference_logprobs = jax.jit(lambda b: policy_logprobs(other, cfg, b)[0])
  records = {}
  for coef in (0.0, 0.1):
    config_ = RLConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=4,
                       seq_len=16)
    steps, _ = helpers.steps(params, cfg, engine=JaxEngine(cfg, params), task=PickADigit(10),
                             tokenizer=tokenizer, loss="rloo", config=config_,
                             kl_reward=KLReward(coef=coef),
                             reference_logprobs=reference_logprobs)
    records[coef] = next(steps)
  plain, with_kl = records[0.0], records[0.1]
  # same samples, only the reward differs
  assert [t.text for t in plain.trajectories] == [t.text for t in with_kl.trajectories]
  # By hand: k1 = engine logp - reference logp, summed over each completion's tokens.
  for i, t in enumerate(plain.trajectories):
    tokens = np.concatenate([t.prompt_ids, t.token_ids])
    batch = jax.tree.map(jnp.asarray, trajectory_batch(
        [t.prompt_ids], [t.token_ids], [t.logprobs], [0.0], [True], 16)[0])
    ref = np.asarray(reference_logprobs(batch))[0][:len(tokens) - 1]
    kl = float(np.sum((np.asarray(batch.old_logp)[0][:len(tokens) - 1] - ref)
                      * np.asarray(batch.loss_mask)[0][:len(tokens) - 1]))
    np.testing.assert_allclose(with_kl.rewards[i], plain.rewards[i] - 0.1 * kl, rtol=1e-4,
                               atol=1e-5)
  assert not np.allclose(with_kl.rewards, plain.rewards)
