"""Several JAX processes on 127.0.0.1 forming one mesh (jax.distributed, gloo on CPU): the train
step on 2 processes x 4 devices equals 1 x 8; experiments/run.py on 2 processes writes its run
directory once, survives a SIGKILL (restarted with the same command it ends with the params of
an uninterrupted run), never reads a checkpoint whose write was cut off, and resumes on another
number of processes; a process whose coordinator is not there says which address failed."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = [os.path.join(ROOT, "experiments/run.py"), "--gin", "experiments/configs/quickstart.gin",
       "--gin", "experiments/configs/tiny.gin", "--gin_param", "train.mesh = @make_mesh()",
       "--gin_param", "make_mesh.data = 2", "--gin_param", "make_mesh.fsdp = 2",
       "--gin_param", "train.checkpoint_every = 1", "--gin_param", "train.eval_every = 0",
       "--gin_param", "train.tensorboard = False"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(argv, processes: int, devices: int, log_dir: str, tag: str):
  """`processes` copies of `python ARGV`, one JAX process each with `devices` CPU devices."""
  port = free_port()
  started = []
  for i in range(processes):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    if processes > 1:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(i))
    log = open(os.path.join(log_dir, f"{tag}.{i}.log"), "w")
    started.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True))
  return started


def kill(processes) -> None:
  for p in processes:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
  for p in processes:
    p.wait(timeout=30)


def finish(processes, log_dir: str, tag: str, timeout: float = 400.0) -> str:
  """Wait for all (killing all at the deadline or when one fails); process 0's log."""
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p in processes):
      failed = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.2)
  finally:
    kill(processes)
  logs = [open(os.path.join(log_dir, f"{tag}.{i}.log")).read() for i in range(len(processes))]
  codes = [p.returncode for p in processes]
  assert codes == [0] * len(processes), f"exit codes {codes}; logs:\n" + "\n----\n".join(
      log[-3000:] for log in logs)
  return logs[0]


def final_params(run_dir: str) -> list[np.ndarray]:
  from rl.checkpoint import Checkpointer
  import jax
  checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
  params = checkpointer.restore_params()
  checkpointer.close()
  return [np.asarray(x) for x in jax.tree.leaves(params)]


STEPS_SCRIPT = """
import json, sys
from models import distributed
distributed.initialize()
import jax, optax
from models import config, sharding, transformer
from models.tokenizer import CharTokenizer
from rl import losses, sft
from rl.tasks.arithmetic import Arithmetic
from rl.train_step import init_train_state, make_train_step
tokenizer, task = CharTokenizer(), Arithmetic(digits=2)
cfg = config.tiny(tokenizer.vocab_size, hidden_size=64, intermediate_size=128)
mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
optimizer = optax.adam(1e-3)
make = lambda: init_train_state(transformer.init_params(cfg, jax.random.PRNGKey(0)), optimizer)
shardings = sharding.state_shardings(jax.eval_shape(make), optimizer, mesh)
state = jax.jit(make, out_shardings=shardings)()
step = sharding.on_mesh(mesh, make_train_step(cfg, optimizer, losses.nll,
                                              state_shardings=shardings))
batches = sft.sft_batches(lambda i: sft.solution_example(task, tokenizer, task.train[i]),
                          len(task.train), batch_size=16, seq_len=32, seed=0)
out = []
for _ in range(3):
  state, metrics = step(state, next(batches))
  out.append(float(metrics["loss"]))
whole = distributed.local_copy(state.params)
out.append(float(sum(abs(x).sum() for x in jax.tree.leaves(whole))))
if distributed.is_primary():
  json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_train_step_on_two_processes_equals_one(tmp_path):
  script = tmp_path / "steps.py"
  script.write_text(f"import sys; sys.path.insert(0, {ROOT!r})\n" + STEPS_SCRIPT)
  finish(start([str(script), str(tmp_path / "two.json")], 2, 4, tmp_path, "two"), tmp_path,
         "two")
  finish(start([str(script), str(tmp_path / "one.json")], 1, 8, tmp_path, "one"), tmp_path,
         "one")
  two, one = (json.load(open(tmp_path / f"{n}.json")) for n in ("two", "one"))
  # Three losses and the updated params' L1 norm: the same global computation.
  np.testing.assert_allclose(two, one, rtol=1e-5)
  assert two[0] > two[2]


@pytest.mark.slow
def test_two_processes_survive_a_kill_and_resume_on_another_count(tmp_path):
  steps = ["--gin_param", "train.num_steps = 3"]
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  log = finish(start([*RUN, *steps, "--run_dir", whole], 2, 2, tmp_path, "whole"), tmp_path,
               "whole")
  assert "2 processes" in log and "sft_accuracy=" in log
  records = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2, 3]  # written once, by process 0
  assert os.path.exists(os.path.join(whole, "config.gin"))

  # SIGKILL one trainer at a random point after its first RL checkpoint, the others with it
  # (what a cluster does with the rest of a job), then the same command again.
  processes = start([*RUN, *steps, "--run_dir", cut], 2, 2, tmp_path, "cut")
  checkpoints = os.path.join(cut, "checkpoints")
  deadline = time.monotonic() + 300
  while not (os.path.isdir(checkpoints) and "1" in os.listdir(checkpoints)):
    assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
        "no RL checkpoint was written"
    time.sleep(0.1)
  time.sleep(random.uniform(0.0, 1.5))
  os.killpg(processes[random.randrange(2)].pid, signal.SIGKILL)
  kill(processes)
  # A checkpoint cut off mid-write is orbax's uncommitted temporary directory: make one for
  # sure, a copy of the newest step with its files half gone, and see it never read.
  newest = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
  half = os.path.join(checkpoints, f"{newest + 1}.orbax-checkpoint-tmp-1")
  subprocess.run(["cp", "-r", os.path.join(checkpoints, str(newest)), half], check=True)
  for name in sorted(os.listdir(half))[::2]:
    subprocess.run(["rm", "-rf", os.path.join(half, name)], check=True)
  log = finish(start([*RUN, *steps, "--run_dir", cut], 2, 2, tmp_path, "resumed"), tmp_path,
               "resumed")
  assert f"resuming from {cut} at RL step {newest}" in log
  for a, b in zip(final_params(whole), final_params(cut)):
    np.testing.assert_array_equal(a, b)

  # One process with the same four devices picks up the two processes' checkpoint.
  log = finish(start([*RUN, "--gin_param", "train.num_steps = 4", "--run_dir", cut], 1, 4,
                     tmp_path, "one"), tmp_path, "one")
  assert f"resuming from {cut} at RL step 3" in log
  assert json.load(open(os.path.join(cut, "summary.json")))["steps"] == 4


def test_unreachable_coordinator_names_the_address(tmp_path):
  port = free_port()  # nobody listens there
  env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
         "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
  started = time.monotonic()
  result = subprocess.run([sys.executable, *RUN, "--gin_param", "initialize.timeout_s = 5",
                           "--run_dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert f"coordinator at 127.0.0.1:{port}" in result.stderr, result.stderr[-2000:]
  assert time.monotonic() - started < 60
  assert not os.path.exists(tmp_path / "run")
