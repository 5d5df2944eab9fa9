"""pass@k, maj@k and mean@k against exact and hand-made cases; the sampled evaluation and
its report on a tiny real model; experiments/eval.py on a saved run. (The loop's periodic
sampled evaluation is tested in test_run_cli.py's resume test.)"""

import itertools
import json
import os
import subprocess
import sys
import threading

import jax
import pytest

from experiments import evaluation
from models import config, transformer
from rl import eval as eval_lib
from rl import loop, rollout, sft
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pass_at_k_equals_enumeration():
  for n in range(1, 8):
    for c in range(n + 1):
      correct = [True] * c + [False] * (n - c)
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        exact = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
        assert eval_lib.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    eval_lib.pass_at_k(4, 1, 5)


def test_maj_at_k_hand_cases():
  # Clear majority, right and wrong.
  assert eval_lib.maj_at_k(["3", "3", "5"], [True, True, False], 3)
  assert not eval_lib.maj_at_k(["5", "3", "5"], [False, True, False], 3)
  # Only the first k samples vote.
  assert eval_lib.maj_at_k(["3", "5", "5", "5"], [True, False, False, False], 1)
  assert not eval_lib.maj_at_k(["3", "5", "5", "5"], [True, False, False, False], 4)
  # Tie: the answer that appeared first wins.
  assert eval_lib.maj_at_k(["3", "5", "5", "3"], [True, False, False, True], 4)
  assert not eval_lib.maj_at_k(["5", "3", "3", "5"], [False, True, True, False], 4)
  # No answer casts no vote; no answers at all is wrong.
  assert eval_lib.maj_at_k([None, None, "3"], [False, False, True], 3)
  assert not eval_lib.maj_at_k([None, None], [False, False], 2)


def test_mean_at_k_hand_cases():
  assert eval_lib.mean_at_k([True, False, True, True], 4) == 0.75
  assert eval_lib.mean_at_k([True, False, True, True], 2) == 0.5
  assert eval_lib.mean_at_k([False] * 3, 3) == 0.0


class HasOne:
  """Real sampled text, real verifier: correct iff the completion contains "1". The
  demonstrations are digit strings of 1 to 6 characters, a third of them with a 1."""

  def __init__(self):
    strings = ["2", "13", "406", "7081", "55555", "912340", "8", "26", "310", "4447", "98765",
               "100000"]
    self.train = self.test = [{"q": f"{i % 6}=", "s": s} for i, s in enumerate(strings)]

  def prompt(self, record):
    return record["q"]

  def solution(self, record):
    return record["s"]

  def verify(self, completion, record):
    return "1" in completion

  def well_formed(self, completion):
    return True

  def answer(self, completion):
    return completion[:1] or None


def test_sampled_eval_and_report(tokenizer, tmp_path):
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=1, intermediate_size=64)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  task = HasOne()
  params, _ = sft.warm_start(params, cfg, task, tokenizer, steps=60, batch_size=12, seq_len=16,
                             progress=False)
  spec = eval_lib.SampledEval(samples=8, ks=(1, 2, 4, 8), budgets=(2, 4, 8))
  prompts = task.test[:6]
  report = eval_lib.sampled_eval(JaxEngine(cfg, params), task, tokenizer, prompts, spec)
  assert report["samples"] == 8 and report["prompts"] == 6
  by_budget = [report["budgets"][b] for b in (2, 4, 8)]
  top = by_budget[-1]
  assert 0 < top["mean@8"] < 1, top  # a mix of right and wrong
  for metrics in by_budget:
    passes = [metrics[f"pass@{k}"] for k in (1, 2, 4, 8)]
    assert passes == sorted(passes)
    assert metrics["pass@1"] == pytest.approx(metrics["mean@8"])
    assert metrics["maj@8"] <= metrics["pass@8"] + 1e-12
  # A completion counts at a budget only if it finished within it.
  accuracy = [m["accuracy"] for m in by_budget]
  assert accuracy == sorted(accuracy)
  assert len(report["lengths"]["correct"]) + len(report["lengths"]["incorrect"]) == 48
  paths = evaluation.write_report(report, str(tmp_path / "report"), title="tiny")
  assert [os.path.basename(p) for p in paths] == [
      "report.json", "accuracy_vs_budget.png", "lengths.png", "pass_at_k.png"]
  for path in paths[1:]:
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert json.load(open(paths[0]))["budgets"]["8"] == top
  assert accuracy[0] < accuracy[-1]


class _BrokenVerifier(Arithmetic):
  def verify(self, completion, record):
    raise ValueError("verifier bug")


class _LosingEngine(JaxEngine):
  """The embedded engine, handing over one completion fewer than it returns."""

  def generate(self, prompts, sampling, *, seed, on_ready=None, **kwargs):
    return super().generate(prompts, sampling, seed=seed,
                            on_ready=lambda ready: on_ready(dict(list(ready.items())[1:])),
                            **kwargs)


def test_generate_and_verify_raises_its_verifiers_and_engines_errors(tiny_cfg, tiny_params,
                                                                     tokenizer):
  """A verifier that raises on its thread raises in the caller; an engine that hands over
  fewer completions than it returns is named; neither leaves the verifying thread running."""
  records = [Arithmetic(digits=1, num_train=4, num_test=1).train[i] for i in range(2)]
  # Stop on every id: each completion finishes (and so is verified) at once.
  sampling = SamplingParams(4, stop_token_ids=tuple(range(tiny_cfg.vocab_size)))
  engine = JaxEngine(tiny_cfg, tiny_params)
  with pytest.raises(ValueError, match="verifier bug"):
    rollout.generate(engine, _BrokenVerifier(digits=1, num_train=4, num_test=1), tokenizer,
                     records, sampling, samples=2)
  with pytest.raises(RuntimeError, match=r"returned 4 completions but handed over 3.*\[0\]"):
    rollout.generate(_LosingEngine(tiny_cfg, tiny_params),
                     Arithmetic(digits=1, num_train=4, num_test=1), tokenizer, records,
                     sampling, samples=2)
  assert not [t for t in threading.enumerate() if t.name == "verifier"]


def test_sampled_eval_rejects_bad_specs():
  with pytest.raises(ValueError, match="ks must lie in"):
    eval_lib.SampledEval(samples=4, ks=(1, 8))
  with pytest.raises(ValueError, match="budgets"):
    eval_lib.SampledEval(budgets=())


def test_eval_cli_on_a_saved_run(tokenizer, tmp_path):
  run_dir = tmp_path / "run"
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, intermediate_size=64)
  params = transformer.init_params(cfg, jax.random.PRNGKey(1))
  parts = helpers.parts(cfg, engine=None, task=Arithmetic(num_train=10), tokenizer=tokenizer,
                        config=RLConfig(prompts_per_step=4))
  state = loop.init_state(params, loop.rl_optimizer(1e-4), parts, 0)
  checkpointer = Checkpointer(str(run_dir / "checkpoints"))
  checkpointer.save(3, state)
  checkpointer.close()
  result = subprocess.run(
      [sys.executable, "experiments/eval.py", "--gin", "experiments/configs/eval.gin",
       "--gin_param", f"evaluate.run_dir = '{run_dir}'", "--out", str(tmp_path / "eval"),
       "--gin_param", "tiny.hidden_size = 32", "--gin_param", "tiny.intermediate_size = 64",
       "--gin_param", "evaluate.num_records = 4", "--gin_param", "SampledEval.samples = 2",
       "--gin_param", "SampledEval.ks = (1, 2)", "--gin_param", "SampledEval.budgets = (8, 16)"],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "pass@2=" in result.stdout
  report = json.load(open(tmp_path / "eval" / "report.json"))
  assert report["prompts"] == 4 and set(report["budgets"]) == {"8", "16"}
  missing = subprocess.run(
      [sys.executable, "experiments/eval.py", "--gin", "experiments/configs/eval.gin",
       "--gin_param", f"evaluate.run_dir = '{tmp_path / 'nowhere'}'"],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert missing.returncode != 0 and "has no checkpoints/ directory" in missing.stderr
