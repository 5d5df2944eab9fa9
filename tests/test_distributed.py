"""Several JAX processes on 127.0.0.1 forming one mesh (jax.distributed, gloo on CPU): the train
step on 2 processes x 4 devices (each placing only its own rows) equals 1 x 8;
experiments/run.py on 2 processes writes its run directory once, survives SIGKILLs at three
points, one of them mid-checkpoint (restarted with the same command, it ends with the params
of an uninterrupted run), never reads a checkpoint whose write was cut off, and resumes on
another number of processes, and makes rollouts ahead of the trainer; two trainers on a server fleet behind the real sglang-router
survive a dead server, stop clearly when the router dies and resume, and a killed trainer
leaves no server behind; a process whose coordinator is not there says which address
failed."""

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
       "--gin_param", "Hooks.checkpoint_every = 1", "--gin_param", "Evaluation.every = 0",
       "--gin_param", "Hooks.tensorboard = False"]


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
  state, metrics = step(state, sharding.place_rows(next(batches), mesh))
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
@pytest.mark.parametrize("engine", ["embedded", "server"])
def test_two_processes_make_rollouts_ahead_of_the_trainer(tmp_path, engine):
  """Ahead.max_staleness = 1 on 2 processes, with the held-out evaluation's and the
  checkpoints' collectives between steps: every step trains all its groups, no token is
  older than the bound, and the rollouts really were made ahead (one version stale)."""
  run_dir = str(tmp_path / "run")
  command = [*RUN, "--gin_param", "train.rollouts = @Ahead()",
             "--gin_param", "Ahead.max_staleness = 1",
             "--gin_param", "Evaluation.every = 2", "--gin_param", "RLConfig.num_steps = 5",
             "--run_dir", run_dir]
  if engine == "server":
    command += ["--gin", "experiments/configs/quickstart_server.gin"]
  log = finish(start(command, 2, 2, tmp_path, "ahead"), tmp_path, "ahead")
  assert "rl_accuracy=" in log
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert all(r["groups_trained"] == 4 for r in records)
  assert all(0 <= r["staleness_max"] <= 1 for r in records)
  assert sum(r["staleness_max"] == 1 for r in records) >= 3, records
  assert all("eval_accuracy" in r for r in records if r["step"] % 2 == 0)


def committed(checkpoints: str) -> list[int]:
  return sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit()) \
      if os.path.isdir(checkpoints) else []


def writing(checkpoints: str) -> list[str]:
  """orbax's uncommitted temporary directories: checkpoints being written."""
  return [d for d in os.listdir(checkpoints) if ".orbax-checkpoint-tmp" in d] \
      if os.path.isdir(checkpoints) else []


def wait_for(condition, what: str, processes, timeout: float = 300.0,
             poll: float = 0.1) -> None:
  """Until condition(); fails if one of `processes` ends or `timeout` s pass first."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
        f"the run ended, or never reached {what}"
    time.sleep(poll)


def kill_one_when(processes, ready, what: str, delay: float = 0.0, poll: float = 0.1) -> None:
  """Once ready() (and `delay` s later), SIGKILL one trainer at random, then the others
  (what a cluster does with the rest of a job); every one must still be running then."""
  wait_for(ready, what, processes, poll=poll)
  time.sleep(delay)
  assert all(p.poll() is None for p in processes), f"the run ended before the kill ({what})"
  os.killpg(processes[random.randrange(len(processes))].pid, signal.SIGKILL)
  kill(processes)


@pytest.mark.slow
def test_two_processes_survive_kills_at_three_points_and_resume_on_another_count(tmp_path):
  steps = ["--gin_param", "RLConfig.num_steps = 4"]
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  log = finish(start([*RUN, *steps, "--run_dir", whole], 2, 2, tmp_path, "whole"), tmp_path,
               "whole")
  assert "2 processes" in log and "sft_accuracy=" in log
  records = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # written once, by process 0
  assert os.path.exists(os.path.join(whole, "config.gin"))

  checkpoints = os.path.join(cut, "checkpoints")
  command = [*RUN, *steps, "--run_dir", cut]
  # 1. While an RL checkpoint is being written: orbax's temporary directory is there when
  # the kill lands, and is never read (the restart resumes from the last committed step).
  kill_one_when(start(command, 2, 2, tmp_path, "cut1"), lambda: any(
      not d.startswith("0.") for d in writing(checkpoints)), "an RL checkpoint write",
      poll=0.002)
  assert any(not d.startswith("0.") for d in writing(checkpoints)), os.listdir(checkpoints)
  newest = committed(checkpoints)[-1]
  # 2. At a random point of an RL step, after the restarted run's first new checkpoint.
  kill_one_when(start(command, 2, 2, tmp_path, "cut2"),
                lambda: committed(checkpoints)[-1] > newest, "a new checkpoint",
                delay=random.uniform(0.0, 0.5))
  # 3. A random moment after it resumed: compiling or stepping.
  kill_one_when(start(command, 2, 2, tmp_path, "cut3"),
                lambda: "resuming from" in open(tmp_path / "cut3.0.log").read(), "the resume",
                delay=random.uniform(0.0, 3.0))
  # A checkpoint cut off mid-write, made for sure: a copy of the newest step with half its
  # files gone, under the next step's temporary name.
  newest = committed(checkpoints)[-1]
  half = os.path.join(checkpoints, f"{newest + 1}.orbax-checkpoint-tmp-1")
  subprocess.run(["cp", "-r", os.path.join(checkpoints, str(newest)), half], check=True)
  for name in sorted(os.listdir(half))[::2]:
    subprocess.run(["rm", "-rf", os.path.join(half, name)], check=True)
  log = finish(start(command, 2, 2, tmp_path, "resumed"), tmp_path, "resumed")
  assert f"resuming from {cut} at RL step {newest}" in log
  for a, b in zip(final_params(whole), final_params(cut)):
    np.testing.assert_array_equal(a, b)

  # One process with the same four devices picks up the two processes' checkpoint.
  log = finish(start([*RUN, "--gin_param", "RLConfig.num_steps = 5", "--run_dir", cut], 1, 4,
                     tmp_path, "one"), tmp_path, "one")
  assert f"resuming from {cut} at RL step 4" in log
  assert json.load(open(os.path.join(cut, "summary.json")))["steps"] == 5


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


def children(pid: int) -> list[tuple[int, str]]:
  """(pid, command line) of each child process of `pid`."""
  out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
  found = []
  for child in map(int, out.split()):
    try:
      found.append((child, open(f"/proc/{child}/cmdline").read().replace("\0", " ")))
    except OSError:
      pass  # already gone
  return found


def steps_written(run_dir: str) -> list[int]:
  path = os.path.join(run_dir, "metrics.jsonl")
  return [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []


def alive(pid: int) -> bool:
  try:  # a zombie has ended; only its parent has not read its exit code yet
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def gone(pids, timeout: float = 15.0) -> bool:
  """Whether every one of `pids` ends within `timeout` s."""
  deadline = time.monotonic() + timeout
  while any(alive(pid) for pid in pids):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)
  return True


@pytest.mark.slow
def test_two_trainers_on_a_fleet_behind_the_router_survive_its_faults(tmp_path):
  """Process 0 of 2 drives two servers behind the real sglang-router: a server killed
  mid-run, the run goes on; the router killed, both trainers stop with a clear error and
  the checkpoint to resume from; restarted, it resumes, and a trainer SIGKILLed then leaves
  no server or router behind."""
  run_dir = str(tmp_path / "run")
  command = [*RUN, "--gin", "experiments/configs/quickstart_server.gin",
             "--gin_param", "local_engine.servers = 2", "--gin_param", "local_engine.router = True",
             "--gin_param", "RLConfig.num_steps = 4", "--run_dir", run_dir]
  processes = start(command, 2, 2, tmp_path, "fleet")
  helpers = []
  try:
    wait_for(lambda: 1 in steps_written(run_dir), "RL step 1", processes)
    helpers = children(processes[0].pid)
    servers = [pid for pid, line in helpers if "rollouts.server" in line]
    routers = [pid for pid, line in helpers if "rollouts.server" not in line]
    assert len(servers) == 2 and len(routers) == 1, helpers
    assert children(processes[1].pid) == []  # process 1 talks to no server
    os.kill(servers[0], signal.SIGKILL)
    wait_for(lambda: 2 in steps_written(run_dir), "RL step 2 after a server died", processes)
    os.kill(routers[0], signal.SIGKILL)
    for p in processes:
      p.wait(timeout=120)
  finally:
    kill(processes)
  logs = [open(tmp_path / f"fleet.{i}.log").read() for i in range(2)]
  assert [p.returncode for p in processes] == [1, 1], logs
  assert "error: router http://127.0.0.1:" in logs[0] and "failed" in logs[0], logs[0][-3000:]
  assert "error: JAX process 0 of 2 failed: ServerError: router" in logs[1], logs[1][-3000:]
  assert "running the same command resumes from it" in logs[0]
  assert "Traceback" not in logs[0] + logs[1]
  assert gone([pid for pid, _ in helpers]), children(processes[0].pid)
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert all(r["groups_trained"] == 4 for r in records[1:])  # every group, on one server
  resumed_from = committed(os.path.join(run_dir, "checkpoints"))[-1]
  assert resumed_from >= 2

  # The same command resumes; then process 0 SIGKILLed alone takes its servers and router
  # with it (they exit with their parent).
  processes = start(command, 2, 2, tmp_path, "again")
  try:
    wait_for(lambda: len(children(processes[0].pid)) == 3, "its servers and router",
             processes)
    helpers = children(processes[0].pid)
    wait_for(lambda: max(steps_written(run_dir)) > resumed_from, "a new RL step", processes)
    os.kill(processes[0].pid, signal.SIGKILL)
    assert gone([pid for pid, _ in helpers]), helpers
  finally:
    kill(processes)
  log = open(tmp_path / "again.0.log").read()
  assert f"resuming from {run_dir} at RL step {resumed_from}" in log


def test_processes_find_each_other_from_the_cluster_environment(tmp_path):
  """initialize.detect_cluster: JAX's own cluster detection, here SLURM's variables as srun
  sets them for two tasks on this host."""
  script = tmp_path / "detect.py"
  script.write_text(f"import sys; sys.path.insert(0, {ROOT!r})\n" + """
from models import distributed
count = distributed.initialize(detect_cluster=True)
import jax
print("joined", count, jax.process_index(), jax.device_count(), flush=True)
""")
  job = str(random.randrange(1, 2**12))
  processes = []
  for i in range(2):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
           "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
    log = open(tmp_path / f"detect.{i}.log", "w")
    processes.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
  finish(processes, tmp_path, "detect", timeout=120)
  for i in range(2):
    assert f"joined 2 {i} 4" in open(tmp_path / f"detect.{i}.log").read()
