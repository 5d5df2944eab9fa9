"""One run per run directory (rl/run_lock.py): a second run on a live directory is refused
with the holder's host and pid, in the same process or another; the hold dies with its
holder; run.py says so in one line and writes nothing."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rl import run_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_held_directory_is_refused_in_the_same_process_until_released(tmp_path):
  first = run_lock.hold(str(tmp_path))
  with pytest.raises(run_lock.RunDirectoryBusy,
                     match=rf"in use by another run: pid {os.getpid()} on host "
                           rf"{socket.gethostname()}, since .*stop that run first"):
    run_lock.hold(str(tmp_path))
  first.release()
  run_lock.hold(str(tmp_path)).release()
  assert os.path.isdir(tmp_path)  # it was there before: kept
  # A directory the hold made is gone once let go, when nothing else was written there.
  run_lock.hold(str(tmp_path / "new")).release()
  assert not os.path.exists(tmp_path / "new")


def _holder(run_dir: str) -> subprocess.Popen:
  """A process that holds `run_dir` until it is killed."""
  code = ("import sys, time; from rl import run_lock; held = run_lock.hold(sys.argv[1]); "
          "print('held', flush=True); time.sleep(120)")
  process = subprocess.Popen([sys.executable, "-c", code, run_dir], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "held"
  return process


def test_the_hold_dies_with_its_holder(tmp_path):
  holder = _holder(str(tmp_path))
  try:
    with pytest.raises(run_lock.RunDirectoryBusy, match=rf"pid {holder.pid} on host"):
      run_lock.hold(str(tmp_path))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  run_lock.hold(str(tmp_path)).release()  # a killed run never blocks the next


def _run_py(run_dir: str, *extra: str) -> list[str]:
  return [sys.executable, os.path.join(ROOT, "experiments/run.py"), "--gin",
          os.path.join(ROOT, "experiments/configs/quickstart.gin"), "--gin",
          os.path.join(ROOT, "experiments/configs/tiny.gin"), "--gin_param",
          "Hooks.progress = False", "--run_dir", run_dir, *extra]


def test_a_second_run_on_a_live_directory_is_refused_and_accepted_once_it_is_killed(tmp_path):
  """run.py on a directory a live run holds stops at once naming the holder, and leaves the
  first run's files as they are; once that run is killed, the same command resumes it."""
  run_dir = str(tmp_path / "run")
  first = subprocess.Popen(_run_py(run_dir, "--gin_param", "RLConfig.num_steps = 100000"),
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 120
    checkpoints = os.path.join(run_dir, "checkpoints")
    while not (os.path.isdir(checkpoints) and any(d.isdigit() for d in os.listdir(checkpoints))):
      assert first.poll() is None, "the first run ended"
      assert time.monotonic() < deadline, "no checkpoint within 120 s"
      time.sleep(0.2)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    started = time.monotonic()
    second = subprocess.run(_run_py(run_dir), cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode != 0
    assert f"in use by another run: pid {first.pid} on host {socket.gethostname()}" in \
        second.stderr, second.stderr[-2000:]
    assert "Traceback" not in second.stderr, second.stderr
    assert time.monotonic() - started < 60
    assert not os.path.exists(metrics + ".discarded")  # it moved nothing of the first run's
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
  last = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
  third = subprocess.run(_run_py(run_dir, "--gin_param", f"RLConfig.num_steps = {last + 2}"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert third.returncode == 0, third.stderr[-3000:]
  assert "resuming from" in third.stdout
