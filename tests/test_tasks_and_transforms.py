"""The arithmetic and needle tasks, reward transforms and prompt sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.tokenizer import CharTokenizer
from rl import rewards, sampling
from rl.tasks import needle
from rl.tasks.arithmetic import Arithmetic, column_solution
from rl.types import Rollouts


def test_column_solution_shows_carries():
  assert "".join(column_solution([47, 85])) == "7+5=12;4+8+1=13;#132"
  assert "".join(column_solution([5, 308, 91])) == "5+8+1=14;0+9+1=10;3+1=4;#404"


def test_reference_solutions_verify_and_wrong_answers_do_not():
  task = Arithmetic(digits=3, operands=3, filler=2, num_train=200, num_test=50)
  for i in range(50):
    record = task.train[i]
    assert task.verify(task.solution(record), record)
    assert sum(map(int, record["question"].split("+"))) == int(record["answer"])
    assert not task.verify(task.solution(record) + "1", record)
    assert not task.verify(task.solution(record)[:-1], record) or record["answer"][:-1] == ""
    assert not task.verify("", record)
    assert task.well_formed(task.solution(record))
    assert not task.well_formed(task.solution(record) + ";") and not task.well_formed("12")


def test_filler_only_lengthens():
  plain = Arithmetic(digits=2, filler=0)
  padded = Arithmetic(digits=2, filler=3)
  grew = 0
  for i in range(100):
    p, q = plain.train[i], padded.train[i]
    assert p["question"] == q["question"]
    assert q["solution"].replace("hmm;", "") == p["solution"]
    assert padded.verify(q["solution"], q)
    grew += len(q["solution"]) > len(p["solution"])
  assert grew > 50


def test_train_and_test_are_disjoint_and_deterministic():
  task = Arithmetic(digits=2, num_train=2000, num_test=300)
  train = {task.train[i]["question"] for i in range(2000)}
  test = {task.test[i]["question"] for i in range(300)}
  assert not train & test
  assert Arithmetic(digits=2).train[17] == task.train[17]
  with pytest.raises(IndexError):
    task.test[300]


def _rollouts(correct, groups):
  n = len(correct)
  return Rollouts(group_ids=jnp.asarray(groups), correct=jnp.asarray(correct),
                  lengths=jnp.full(n, 5), truncated=jnp.zeros(n, bool),
                  well_formed=jnp.ones(n, bool),
                  reward=jnp.zeros(n), loss_mask=jnp.ones(n, bool), num_groups=max(groups) + 1)


def test_correctness_and_named_chain():
  chain = rewards.named_chain({"first": rewards.correctness(),
                               "second": rewards.correctness(correct=2.0, incorrect=-1.0)})
  state = chain.init()
  assert set(state) == {"first", "second"}
  out, _ = chain.update(_rollouts([True, False, True], [0, 0, 1]), state, step=0)
  np.testing.assert_allclose(out.reward, [2.0, -1.0, 2.0])
  out = jax.jit(lambda r, s: chain.update(r, s, step=0))(_rollouts([True, False], [0, 0]), state)
  np.testing.assert_allclose(out[0].reward, [2.0, -1.0])


def test_uniform_sampler_and_prompt_stats():
  sampler = sampling.uniform()
  stats = sampling.PromptStats.create(10)
  weights, _ = sampler.update(stats, sampler.init(10), step=0)
  indices = sampling.draw(jax.random.PRNGKey(0), weights, 6)
  assert len(set(np.asarray(indices).tolist())) == 6
  stats = stats.record(indices, 4, jnp.asarray([0, 1, 2, 3, 4, 4]), step=3)
  assert int(stats.attempts.sum()) == 24 and int(stats.successes.sum()) == 14
  assert sorted(np.flatnonzero(np.asarray(stats.last_seen) == 3)) == sorted(np.asarray(indices))
  with pytest.raises(ValueError, match="cannot draw 11"):
    sampling.draw(jax.random.PRNGKey(0), weights, 11)


def test_sloppy_demonstrations_drop_only_the_final_carry():
  sloppy = Arithmetic(digits=2, operands=3, sloppy=1.0)
  exact = Arithmetic(digits=2, operands=3)
  dropped = 0
  for i in range(200):
    bad, good = sloppy.train[i], exact.train[i]
    assert bad["question"] == good["question"] and bad["answer"] == good["answer"]
    assert exact.verify(good["solution"], good)
    if sloppy.verify(bad["solution"], bad):
      assert bad["solution"] == good["solution"]
    else:  # same steps; the answer lost its leading carry digit
      dropped += 1
      steps, answer = bad["solution"].rsplit("#", 1)
      assert good["solution"] == f"{steps}#{good['answer']}"
      assert answer == good["answer"][1:]
  assert 50 < dropped < 150
  with pytest.raises(ValueError, match="sloppy"):
    Arithmetic(sloppy=1.5)


def test_direct_demonstrations_are_the_bare_answer_of_the_same_problems():
  shortcut = Arithmetic(digits=2, operands=3, filler=4, direct=0.3)
  full = Arithmetic(digits=2, operands=3, filler=4)
  bare = 0
  for i in range(400):
    short, long = shortcut.train[i], full.train[i]
    assert short["question"] == long["question"] and shortcut.verify(short["solution"], short)
    assert shortcut.well_formed(short["solution"])
    if short["solution"] != long["solution"]:
      bare += 1
      assert short["solution"] == "#" + long["answer"]
  assert 0.25 < bare / 400 < 0.35
  with pytest.raises(ValueError, match="direct"):
    Arithmetic(direct=-0.1)


def test_needle_haystacks_are_their_length_and_their_key_is_asked_once():
  task = needle.Needle(context=1000, num_train=5, num_test=5)
  tokenizer = CharTokenizer()
  record = task.train[3]
  prompt = task.prompt(record)
  assert 990 <= len(tokenizer.encode(prompt)) <= 1000  # one token a character
  haystack, key = prompt[:-1].split("?")
  pairs = dict(entry.split(":") for entry in haystack.rstrip(";").split(";"))
  assert len(pairs) == haystack.count(";")  # every key once
  assert pairs[key] == record["answer"]
  assert task.verify(task.solution(record), record) and task.well_formed(task.solution(record))
  wrong = f"#{(int(record['answer']) + 1) % 10_000:04d}"
  assert not task.verify(wrong, record) and not task.verify(record["answer"], record)
  assert task.train[3] == record and task.test[3] != record
  depths = [task.train[i]["depth"] for i in range(5)]
  assert len(set(depths)) > 1 and all(0 <= d < 1 for d in depths)
  with pytest.raises(ValueError, match="Needle.context"):
    needle.Needle(context=5)


def test_task_records_slice_as_a_list_and_name_an_index_out_of_range(tmp_path):
  from rl.tasks.jsonl import read_records
  path = tmp_path / "train.jsonl"
  path.write_text("".join(f'{{"problem": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(5)))
  records = read_records(path, ("problem", "answer"))
  assert records[1:3] == [{"problem": "1+1", "answer": "2"}, {"problem": "2+1", "answer": "3"}]
  assert records[-2:] == list(records.records[-2:]) and records[:0] == []
  with pytest.raises(IndexError, match=r"train.jsonl: index 5 out of range \[0, 5\)"):
    records[5]
