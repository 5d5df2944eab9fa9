"""rl/samples.py and its hooks: a run writes a few trajectories of every evaluation and of
every Hooks.samples_every-th step to samples.jsonl and to TensorBoard as a Markdown table; a
resumed run keeps no samples of the steps it redoes; bad bindings fail before anything runs."""

import dataclasses
import os

import numpy as np
import pytest

from models import config
from models.tokenizer import CharTokenizer
from rl import ConfigError, hooks, loggers, metrics, rollout, samples, trainer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from tests.test_logging import tensorboard_events

TASK = Arithmetic(digits=1, num_train=500, num_test=50)
MODEL = lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64)
SIZES = RLConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16, seq_len=32)


def test_pick_spreads_over_the_trajectories():
  assert samples.pick(3, 8) == [0, 3, 7]
  assert samples.pick(4, 16) == [0, 5, 10, 15]  # groups of 4: a sample of each prompt
  assert samples.pick(1, 8) == [0]
  assert samples.pick(0, 8) == [] and samples.pick(3, 0) == []
  assert samples.pick(10, 3) == [0, 1, 2]
  for count in range(1, 12):  # distinct and in order, at most n
    picked = samples.pick(count, 11)
    assert picked == sorted(set(picked)) and len(picked) == count


def test_markdown_table_keeps_one_row_per_line():
  text = loggers.markdown_table(("prompt", "reward", "answer"),
                                [["a|b\nc", 0.123456, None], ["x", 1.0, "7"]])
  assert text.splitlines() == ["| prompt | reward | answer |", "| --- | --- | --- |",
                               "| a\\|b<br>c | 0.1235 |  |", "| x | 1 | 7 |"]


@pytest.mark.parametrize("binding", ["samples", "samples_every"])
def test_a_negative_samples_binding_is_refused_by_name(tmp_path, binding):
  with pytest.raises(ConfigError, match=f"Hooks.{binding}=-1"):
    trainer.build(str(tmp_path / "run"), task=TASK, model=MODEL, rl=SIZES,
                  hooks=trainer.Hooks(progress=False, **{binding: -1}))
  assert not os.path.exists(tmp_path / "run")


class _Keep(hooks.Hook):
  """Keeps each step's trajectories, rewards and advantages; raises at step `fail_at`."""

  def __init__(self, fail_at: int = -1):
    self.kept, self.fail_at = {}, fail_at

  def step(self, run, record) -> None:
    self.kept[record.step] = (record.trajectories, record.rewards, record.advantages)
    if record.step == self.fail_at:
      raise RuntimeError("interrupted")


def _train(run_dir: str, keep: _Keep) -> None:
  trainer.train(run_dir, task=TASK, model=MODEL,
                rl=dataclasses.replace(SIZES, num_steps=5),
                start=trainer.WarmStart(steps=5, batch_size=16),
                hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=8, every=2),
                                    checkpoint_every=3, samples=3, samples_every=2,
                                    progress=False, extra=[keep]))


@pytest.mark.slow
def test_a_run_writes_samples_of_its_steps_and_evaluations_once_across_a_resume(tmp_path):
  run_dir = str(tmp_path / "run")
  first, second = _Keep(fail_at=4), _Keep()
  with pytest.raises(RuntimeError, match="interrupted"):
    _train(run_dir, first)  # step 4's samples are written, its checkpoint is not
  path = os.path.join(run_dir, samples.FILE)
  _train(run_dir, second)  # resumes from step 3 and redoes step 4

  written = metrics.read(path)
  assert [(r["step"], r["split"]) for r in metrics.read(path + ".discarded")] == [
      (4, "eval")] * 3 + [(4, "train")] * 3
  assert [(r["step"], r["split"]) for r in written] == [
      (step, split) for step, split in [(0, "eval"), (2, "eval"), (2, "train"), (4, "eval"),
                                        (4, "train"), (5, "final")]
      for _ in range(3)]
  tokenizer = CharTokenizer()
  steps = {2: first.kept[2], 4: second.kept[4]}
  logged = {r["step"]: r for r in metrics.read(os.path.join(run_dir, "metrics.jsonl"))}
  for step, (trajectories, rewards, advantages) in steps.items():
    rows = [r for r in written if r["split"] == "train" and r["step"] == step]
    picked = samples.pick(3, len(trajectories))
    assert [r["prompt"] for r in rows] == [tokenizer.decode(trajectories[i].prompt_ids)
                                           for i in picked]
    assert [r["completion"] for r in rows] == [tokenizer.decode(trajectories[i].token_ids)
                                               for i in picked]
    assert [r["correct"] for r in rows] == [trajectories[i].correct for i in picked]
    assert [r["length"] for r in rows] == [trajectories[i].policy_count for i in picked]
    np.testing.assert_allclose([r["reward"] for r in rows], rewards[picked])
    np.testing.assert_allclose([r["advantage"] for r in rows], advantages[picked])
    assert logged[step]["reward"] == pytest.approx(float(np.mean(rewards)))
  for r in written:
    assert r["answer"] == TASK.answer(r["completion"])
    assert r["expected"] is not None and r["finish"] in ("stop", "length")
  evals = [r for r in written if r["split"] != "train"]
  assert all(r["reward"] is None and r["advantage"] is None for r in evals)
  assert [r["prompt"] for r in evals] == [tokenizer.decode(rollout.prompt_ids(
      TASK, tokenizer, TASK.test[i])) for i in samples.pick(3, 8)] * 4

  # TensorBoard: each split's table at each step, its rows the file's; the resumed writer's
  # SessionLog START at step 4 hides the first file's tables of step 4.
  events = tensorboard_events(run_dir)
  tables = [(e.step, v.tag, v.tensor.string_val[0].decode()) for e in events
            for v in e.summary.value if v.tag.startswith("samples/")]
  assert [e.step for e in events if e.HasField("session_log")] == [4]
  assert [(step, tag.removesuffix("/text_summary")) for step, tag, _ in tables] == [
      (0, "samples/eval"), (2, "samples/eval"), (2, "samples/train"),
      (4, "samples/eval"), (4, "samples/train"),  # the interrupted run's
      (4, "samples/eval"), (4, "samples/train"), (5, "samples/final")]
  text = tables[-2][2]
  rows = [r for r in written if (r["step"], r["split"]) == (4, "train")]
  assert text == loggers.markdown_table(samples.COLUMNS, samples.cells(rows))
  assert len(text.splitlines()) == 2 + 3
