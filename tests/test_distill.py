"""On-policy distillation's teachers: scoring given tokens (embedded engine and our server over
SGLang's protocol) equals the trainer's log-probs, and routing sends each record to its
teacher."""

import numpy as np
import pytest

from rl import ConfigError, distill
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rl.trajectory import Trajectory
from rollouts.jax_engine import JaxEngine
from rollouts.sglang_engine import local_engine


def _pairs(vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, vocab, n).tolist() for n in (5, 9, 3, 12)]
  continuations = [rng.integers(3, vocab, n).tolist() for n in (7, 2, 11, 1)]
  return prompts, continuations


def _trainer_logprobs(params, cfg, prompts, continuations):
  """The trainer's own log-probs of each continuation, from a packed TrainBatch."""
  batch, placements = trajectory_batch(prompts, continuations,
                                       [np.zeros(len(c)) for c in continuations],
                                       [0.0] * len(prompts), [True] * len(prompts), 64)
  logp = np.asarray(policy_logprobs(params, cfg, batch)[0])
  return [logp[row, start + len(p) - 1:start + len(p) - 1 + len(c)]
          for (row, start), p, c in zip(placements, prompts, continuations)]


def test_teacher_scoring_equals_the_trainers_logprobs(tiny_cfg, tiny_params):
  prompts, continuations = _pairs(tiny_cfg.vocab_size)
  want = _trainer_logprobs(tiny_params, tiny_cfg, prompts, continuations)
  embedded = JaxEngine(tiny_cfg, tiny_params).score(prompts, continuations)
  embedded_top = JaxEngine(tiny_cfg, tiny_params).score_top_k(prompts, continuations, 3)
  engine = local_engine(tiny_cfg, tiny_params, 3)
  try:
    served = engine.score(prompts, continuations)
    served_top = engine.score_top_k(prompts, continuations, 3)  # SGLang's top_logprobs_num
  finally:
    engine.close()
  for w, e, s, c in zip(want, embedded, served, continuations):
    assert e.shape == s.shape == (len(c),)
    np.testing.assert_allclose(e, w, atol=1e-4)
    np.testing.assert_allclose(s, w, atol=1e-4)
  for (e_lp, e_ids, e_top), (s_lp, s_ids, s_top), w, c in zip(embedded_top, served_top, want,
                                                              continuations):
    assert s_ids.shape == s_top.shape == (len(c), 3) and s_ids.dtype == np.int32
    np.testing.assert_allclose(s_lp, w, atol=1e-4)
    np.testing.assert_array_equal(s_ids, e_ids)
    np.testing.assert_allclose(s_top, e_top, atol=1e-4)


def test_the_server_answers_sglangs_input_logprobs(tiny_cfg, tiny_params):
  """As SGLang's, the entry at logprob_start_len (and its top-k row) is null, also past the
  first token: to score token s, ask from s - 1; a stale weight version is refused."""
  prompts, continuations = _pairs(tiny_cfg.vocab_size, seed=1)
  engine = local_engine(tiny_cfg, tiny_params, 0)
  post = lambda body: engine.client._run(engine.client._post_generate(
      {"rid": "s", **body}, 0, engine.client._limits(), {}, 1, {}))
  try:
    ids = prompts[0] + continuations[0]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    for start in (0, len(prompts[0]) - 1):
      _, reply = post({**body, "logprob_start_len": start})
      entries = reply["meta_info"]["input_token_logprobs"]
      assert [e[1] for e in entries] == ids[start:] and entries[0][0] is None
      want = _trainer_logprobs(tiny_params, tiny_cfg, [ids[:start + 1]], [ids[start + 1:]])[0]
      np.testing.assert_allclose([e[0] for e in entries[1:]], want, atol=1e-4)
    assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"]["type"] == "length"
    _, reply = post({**body, "top_logprobs_num": 2})
    top = reply["meta_info"]["input_top_logprobs"]
    assert len(top) == len(ids) and top[0] is None  # as the first input token's log-prob
    assert all(len(row) == 2 and row[0][0] >= row[1][0] for row in top[1:])
    with pytest.raises(Exception, match="is higher than the number of input tokens"):
      post({**body, "logprob_start_len": len(ids) + 1})
    with pytest.raises(Exception, match="top_logprobs_num > 0 is served for prompt scoring"):
      post({**body, "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 4}})
    engine._version = 5  # the servers still hold version 0
    with pytest.raises(Exception, match=r"weight version\(s\) \[0\], not 5"):
      engine.score(prompts, continuations)
  finally:
    engine.close()


class _Recorder:
  """A scorer that remembers what it was asked and answers its own id on every token."""

  def __init__(self, value: float, version: int):
    self.value, self.version, self.calls = value, version, []

  def score(self, prompts, continuations):
    self.calls.append([list(p) for p in prompts])
    return [np.full(len(c), self.value, np.float32) for c in continuations]


def test_routing_sends_each_record_to_its_teacher_in_one_batch():
  add, sub, low = _Recorder(-0.1, 4), _Recorder(-0.2, 5), _Recorder(-0.3, 6)
  teachers = distill.Teachers({"add": add, "sub": sub, "low": low},
                              {"add": "add", "sub/low": "low", "sub": "sub"})
  records = [{"domain": "add"}, {"domain": "sub", "effort": "high"},
             {"domain": "sub", "effort": "low"}, {"domain": "add", "effort": "low"}]
  prompts = [[1, 2], [3], [4, 5, 6], [7]]
  trajectories = [Trajectory(record, tuple(prompt), token_ids=[9] * n, logprobs=[-1.0] * n)
                  for record, prompt, n in zip(records, prompts, (2, 3, 1, 4))]
  scores, top, metrics = distill.teacher_logprobs(teachers, trajectories)
  assert top is None
  assert add.calls == [[[1, 2], [7]]] and sub.calls == [[[3]]] and low.calls == [[[4, 5, 6]]]
  for got, want in zip(scores, [[-0.1] * 2, [-0.2] * 3, [-0.3], [-0.1] * 4]):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  assert metrics["teacher_version/add"] == 4 and metrics["teacher_share/add"] == 0.5
  # mean(old - teacher) over all 10 tokens: old is -1 everywhere
  np.testing.assert_allclose(metrics["student_teacher_kl"],
                             -1 - (-0.1 * 6 - 0.2 * 3 - 0.3) / 10, rtol=1e-6)
  with pytest.raises(ConfigError, match=r"no teacher for a record of domain 'mul'.*add one of"):
    teachers.route({"domain": "mul"})
  with pytest.raises(ConfigError, match=r"name teacher\(s\) \['gone'\]"):
    distill.Teachers({"add": add}, {"*": "gone"})


def test_teachers_load_from_a_run_or_a_hugging_face_directory(tmp_path, tiny_cfg, tiny_params):
  from models import hf
  from rl import checkpoint
  hf.save(tiny_params, tiny_cfg, str(tmp_path / "hf"))
  checkpoint.save_policy(str(tmp_path / "run"), tiny_params)
  prompts, continuations = _pairs(tiny_cfg.vocab_size)
  want = JaxEngine(tiny_cfg, tiny_params).score(prompts, continuations)
  for path in ("hf", "run"):
    got = distill.load_teacher(str(tmp_path / path), tiny_cfg).score(prompts, continuations)
    for w, g in zip(want, got):
      np.testing.assert_allclose(g, w, atol=1e-5)
  with pytest.raises(ConfigError, match="neither a longrl run"):
    distill.load_teacher(str(tmp_path), tiny_cfg)
  assert distill.from_checkpoints(tiny_cfg, paths={"t": str(tmp_path / "hf")},
                                  routes={"*": "t"}).route({}) == "t"


def test_top_k_teacher_scores_and_the_students_top_k_term(tiny_cfg, tiny_params):
  """score_top_k gives each continuation token's k most likely replacements with their
  log-probs (checked against the full distribution); the train step fills the student's
  log-probs of those tokens and opd's topk_kl is KL(teacher || student) over them."""
  import jax
  import jax.numpy as jnp
  import optax

  from models import transformer
  from rl import losses
  from rl.train_step import init_train_state, make_train_step

  prompts, continuations = _pairs(tiny_cfg.vocab_size)
  teacher_params = transformer.init_params(tiny_cfg, jax.random.PRNGKey(5))
  top = JaxEngine(tiny_cfg, teacher_params).score_top_k(prompts, continuations, 3)
  for (_, ids, logp), p, c in zip(top, prompts, continuations):
    full = list(p) + list(c)
    hidden = transformer.forward(teacher_params, tiny_cfg, jnp.asarray([full]),
                                 jnp.arange(len(full))[None], jnp.ones((1, len(full)), int))
    dist = np.asarray(jax.nn.log_softmax(
        hidden[0] @ transformer.output_projection(teacher_params, tiny_cfg)))
    want = dist[len(p) - 1:len(full) - 1]  # the distribution each continuation token was drawn at
    assert ids.shape == logp.shape == (len(c), 3)
    np.testing.assert_array_equal(ids, np.argsort(-want, axis=-1)[:, :3])
    np.testing.assert_allclose(logp, np.take_along_axis(want, ids, -1), atol=1e-5)

  scores = JaxEngine(tiny_cfg, teacher_params).score(prompts, continuations)
  for (from_top, _, _), s in zip(top, scores):
    np.testing.assert_allclose(from_top, s, atol=1e-6)  # the same prefill
  batch, _ = trajectory_batch(prompts, continuations,
                              _trainer_logprobs(tiny_params, tiny_cfg, prompts, continuations),
                              [0.0] * 4, [True] * 4, 64, token_fields={
                                  "teacher_logp": scores,
                                  "teacher_topk_ids": [ids for _, ids, _ in top],
                                  "teacher_topk_logp": [logp for _, _, logp in top]})
  batch = jax.tree.map(jnp.asarray, batch)
  optimizer = optax.sgd(0.0)
  step = make_train_step(tiny_cfg, optimizer, losses.bind("opd", {"topk_coef": 1.0}))
  _, metrics = step(init_train_state(tiny_params, optimizer), batch)
  student = np.asarray(jax.nn.log_softmax(np.asarray(
      transformer.forward(tiny_params, tiny_cfg, batch.tokens, batch.positions,
                          batch.segment_ids)) @ np.asarray(
      transformer.output_projection(tiny_params, tiny_cfg)), axis=-1))
  student_top = np.take_along_axis(student, np.asarray(batch.teacher_topk_ids), -1)
  log_norm = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))
  t, s = log_norm(np.asarray(batch.teacher_topk_logp)), log_norm(student_top)
  kl = (np.exp(t) * (t - s)).sum(-1)
  mask = np.asarray(batch.loss_mask)
  np.testing.assert_allclose(float(metrics["topk_kl"]), (kl * mask).sum() / mask.sum(),
                             rtol=1e-4)
  with pytest.raises(ConfigError, match="cannot give top-k"):
    distill.Teachers({"t": _Recorder(0.0, 0)}, {"*": "t"}, top_k=2)


def test_a_mixture_tags_each_record_with_its_domain_and_dispatches_to_its_task():
  from rl.tasks.arithmetic import Arithmetic
  from rl.tasks.mixture import Mixture
  two, three = Arithmetic(operands=2, num_train=10, num_test=4), Arithmetic(operands=3,
                                                                           num_train=6)
  mixture = Mixture({"add2": two, "add3": three})
  assert len(mixture.train) == 12 and len(mixture.test) == 8
  records = [mixture.train[i] for i in range(4)]
  assert [r["domain"] for r in records] == ["add2", "add3", "add2", "add3"]
  assert records[1] == {**three.train[0], "domain": "add3"}
  assert records[1]["question"].count("+") == 2
  for r in records:
    assert mixture.prompt(r) == r["question"] + "="
    assert mixture.verify(f"#{r['answer']}", r) and not mixture.verify("#0", r)
  assert [r["domain"] for r in (mixture.only("add3").test[i] for i in range(2))] == ["add3"] * 2
  with pytest.raises(ValueError, match="no domain 'add4'"):
    mixture.only("add4")


def test_a_wrong_teacher_stops_the_run_before_it_starts(tmp_path):
  import os

  from models import config
  from rl import trainer
  from rl.tasks.arithmetic import Arithmetic
  teachers = lambda cfg: distill.from_checkpoints(cfg, paths={"t": str(tmp_path / "nowhere")},
                                                  routes={"*": "t"})
  hooks = trainer.Hooks(evaluation=trainer.Evaluation(records=4), progress=False)
  with pytest.raises(ConfigError, match="nowhere.*neither a longrl run"):
    trainer.train(str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=64, num_test=4),
                  model=config.tiny, objective=trainer.Objective(loss="opd", teachers=teachers),
                  hooks=hooks)
  with pytest.raises(ConfigError, match="loss 'opd' reads teacher log-probs"):
    trainer.train(str(tmp_path / "run"), task=Arithmetic(digits=1, num_train=64, num_test=4),
                  model=config.tiny, objective=trainer.Objective(loss="opd"), hooks=hooks)
  assert not os.path.exists(tmp_path / "run")
