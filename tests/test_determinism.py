"""Reproducible runs (RLConfig.deterministic): the quickstart run twice is the same run, on the
embedded engine and through a server process (scripts/check_determinism.py, which compares as
scripts/same_run.py does); the checker names the first difference when there is one; a
deterministic server answers a request alike whatever shares its batch; and what depends on
timing is refused before anything is compiled."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "experiments/configs/quickstart.gin")
TINY = os.path.join(ROOT, "experiments/configs/tiny.gin")
SERVER = os.path.join(ROOT, "experiments/configs/quickstart_server.gin")
PARTIAL = os.path.join(ROOT, "experiments/configs/partial_rollouts.gin")


def check(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts/check_determinism.py"),
                         *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("configs", [[QUICKSTART, TINY], [QUICKSTART, TINY, SERVER]],
                         ids=["embedded", "server"])
def test_the_quickstart_twice_is_the_same_run(configs):
  result = check(*[arg for path in configs for arg in ("--gin", path)], "--steps", "2")
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "same run (2 steps)" in result.stdout


@pytest.mark.slow
def test_the_checker_names_the_first_difference():
  result = check("--gin", QUICKSTART, "--gin", TINY, "--steps", "1", "--second",
                 "train.seed = 1")
  assert result.returncode == 1, result.stdout + result.stderr[-3000:]
  first = result.stdout.strip().splitlines()[-1]
  assert first.startswith("first difference: metrics.jsonl record 0 "), first


def test_a_deterministic_server_answers_a_request_alike_in_any_batch(tokenizer):
  """In process: one request alone, then among others (a batch of 61, others of its
  prompt-width bucket or not, with other max_new_tokens, before and after it), gets the same
  tokens and log-probs bit for bit; so does a prompt scored alone or with others. At the
  quickstart's model sizes XLA:CPU's matmuls sum a row differently in a batch of 64 rows than
  in one of 8 (without --deterministic, the batch of 61 moves the request's log-probs by
  ~5e-7)."""
  from models import config, transformer
  from rollouts.server.protocol import Request
  from rollouts.server.scheduler import Scheduler
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=384)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  scheduler = Scheduler(cfg, params, max_batch=64, deterministic=True)

  def request(rid, length, seed, max_new=12):
    return Request(rid=rid, input_ids=[(5 * i + seed) % 40 + 3 for i in range(length)],
                   max_new_tokens=max_new, temperature=1.0, top_p=0.9, stop_token_ids=(),
                   seed=seed, return_logprob=True)

  def served(batch):
    scheduler.submit(batch)
    assert all(r.done.wait(120) for r in batch)
    return batch

  try:
    alone, = served([request("r", 5, 7)])
    for others in ([request(f"a{i}", 3 + i % 10, i) for i in range(60)],
                   [request("b0", 20, 1), request("b1", 5, 2, max_new=40)],
                   [request(f"c{i}", 4 + 3 * i, i, max_new=10 + 4 * i) for i in range(6)]):
      again = request("r", 5, 7)
      served(others[:len(others) // 2] + [again] + others[len(others) // 2:])
      assert again.tokens == alone.tokens
      np.testing.assert_array_equal(np.float32(again.logprobs), np.float32(alone.logprobs))
    # Prompt scoring (teachers): alone, or in one call with a longer prompt asking for top-k.
    scored = lambda rid, length, top=0: dataclasses.replace(
        request(rid, length, 3, max_new=0), logprob_start_len=1, top_logprobs_num=top)
    alone, = served([scored("s", 9)])
    again = scored("s", 9)
    served([scored("t", 40, top=3), again])
    assert again.input_logprobs == alone.input_logprobs
  finally:
    with scheduler.lock:
      scheduler.stopped = True
      scheduler.lock.notify_all()


@pytest.mark.parametrize("configs,bindings,message", [
    ([QUICKSTART], ["train.rollouts = @Ahead()"], "RLConfig.deterministic: rollouts Ahead"),
    ([QUICKSTART, SERVER, PARTIAL], [], "RLConfig.deterministic: Partial rollouts on an engine"),
], ids=["ahead", "partial_on_a_server"])
def test_a_reproducible_run_refuses_what_depends_on_timing(tmp_path, configs, bindings,
                                                           message):
  run_dir = str(tmp_path / "run")
  args = [arg for path in configs for arg in ("--gin", path)]
  bindings = [*bindings, "RLConfig.deterministic = True"]
  args += [arg for b in bindings for arg in ("--gin_param", b)]
  result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/run.py"), *args,
                           "--run_dir", run_dir], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=dict(os.environ, JAX_LOG_COMPILES="1"))
  assert result.returncode != 0
  assert message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr and "Compiling" not in result.stderr
  assert not os.path.exists(os.path.join(run_dir, "checkpoints"))
