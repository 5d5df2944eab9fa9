"""The model-scored verifier: verdict parsing, one batched judge call per step's completions,
the time bound and the rule-based fallback, and the combination modes, with tiny real judges
(one trained to always answer "verdict: correct", one untrained)."""

import jax
import numpy as np
import pytest

from models import transformer
from rl import rollout
from rl import sft
from rl.tasks.arithmetic import Arithmetic
from rl.trajectory import column
from rl.verifiers.judge import Judge, JudgedTask, parse_verdict
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

TEMPLATE = "{problem}{response}?"


def test_parse_verdict():
  assert parse_verdict("Verdict: correct") == 1.0
  assert parse_verdict("verdict: yes, I think") == 1.0
  assert parse_verdict("The response... Verdict: **incorrect**.") == 0.0
  assert parse_verdict("verdict: correct. On reflection, verdict: fail") == 0.0  # the last
  assert parse_verdict("Score: 0.8") == 0.8
  assert parse_verdict("score: 1.5") is None  # outside [0, 1]
  assert parse_verdict("it is correct") is None
  assert parse_verdict("") is None


class _Counting:
  """A real engine that counts its generate calls."""

  def __init__(self, engine):
    self.engine, self.calls = engine, 0
    self.version = engine.version

  def generate(self, prompts, sampling, *, seed):
    self.calls += 1
    return self.engine.generate(prompts, sampling, seed=seed)


class _Verdicts:
  """A task whose every reference completion is the same verdict."""

  def __init__(self, task):
    self.train = [{"prompt": TEMPLATE.format(problem=task.prompt(r), response=task.solution(r))}
                  for r in (task.train[i] for i in range(64))]

  def prompt(self, record):
    return record["prompt"]

  def solution(self, record):
    return "verdict: correct"


@pytest.fixture(scope="module")
def task():
  return Arithmetic(digits=1, num_train=64, num_test=16)


@pytest.fixture(scope="module")
def lenient_judge(tiny_cfg, tiny_params, task, tokenizer):
  params, _ = sft.warm_start(tiny_params, tiny_cfg, _Verdicts(task), tokenizer,
                             steps=60, batch_size=16, seq_len=64, progress=False)
  return JaxEngine(tiny_cfg, params)


def _completions(task):
  records = [task.test[i] for i in range(8)]
  right = [task.solution(r) for r in records[:4]]
  wrong = ["1+1=2;#999" for _ in records[4:]]
  return right + wrong, records


def test_a_lenient_judge_in_each_combination(lenient_judge, task, tokenizer):
  completions, records = _completions(task)
  engine = _Counting(lenient_judge)
  judge = Judge(engine, tokenizer, template=TEMPLATE, max_new_tokens=24)
  rule = [task.verify(c, r) for c, r in zip(completions, records)]
  assert rule == [True] * 4 + [False] * 4
  verdicts = JudgedTask(task, judge, "judge").judged(completions, records)
  assert engine.calls == 1  # one batched call for all eight
  assert all(v.source == "judge" and v.score == 1.0 for v in verdicts), verdicts
  assert [v.correct for v in verdicts] == [True] * 8
  assert JudgedTask(task, judge, "and").verify_batch(completions, records) == rule
  assert JudgedTask(task, judge, "or").verify_batch(completions, records) == [True] * 8
  judge.close()


def test_an_unparseable_or_late_judge_falls_back_to_the_rule(tiny_cfg, tiny_params, task,
                                                           tokenizer):
  completions, records = _completions(task)
  rule = [task.verify(c, r) for c, r in zip(completions, records)]
  untrained = Judge(JaxEngine(tiny_cfg, tiny_params), tokenizer, template=TEMPLATE,
                    max_new_tokens=8)
  verdicts = JudgedTask(task, untrained).judged(completions, records)
  assert [v.correct for v in verdicts] == rule
  assert {v.source for v in verdicts} == {"fallback: unparseable"}
  other = transformer.init_params(tiny_cfg, jax.random.PRNGKey(3))  # nothing compiled for it
  late = Judge(JaxEngine(tiny_cfg, other), tokenizer, template=TEMPLATE, max_new_tokens=48,
               timeout=1e-3)
  verdicts = JudgedTask(task, late).judged(completions, records)
  assert [v.correct for v in verdicts] == rule
  assert {v.source for v in verdicts} == {"fallback: timeout"}
  late.close()
  untrained.close()
  with pytest.raises(ValueError, match=r"lacks \['\{response\}'\]"):
    Judge(JaxEngine(tiny_cfg, tiny_params), tokenizer, template="{problem}")
  with pytest.raises(ValueError, match="combine='xor'"):
    JudgedTask(task, untrained, "xor")


def test_the_loop_scores_a_judged_task_in_one_batch(lenient_judge, task, tokenizer):
  """rollout.verify (the loop's scoring) uses verify_batch: one judge call per scored batch, and
  truncated completions are never judged correct."""
  engine = _Counting(lenient_judge)
  judged = JudgedTask(task, Judge(engine, tokenizer, template=TEMPLATE, max_new_tokens=24))
  records = [task.train[i] for i in range(4)]
  trajectories = rollout.generate(lenient_judge, judged, tokenizer, records,
                                  SamplingParams(max_new_tokens=12), samples=2, seed=0)
  correct = column(trajectories, "correct", bool)
  truncated = column(trajectories, "truncated", bool)
  assert engine.calls == (1 if (~truncated).any() else 0)
  assert not correct[truncated].any()
  np.testing.assert_array_equal(correct, ~truncated)  # lenient: all finished
  judged.judge.close()
