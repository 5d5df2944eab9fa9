"""The real SGLang 0.5.23 server on this CPU, for the tests: started from the environment
scripts/setup_sglang.sh makes (.venv-sglang, or LONGRL_SGLANG_PYTHON), on 127.0.0.1, and
stopped with every process it started.

How it runs here (../shared/reference/sglang_on_cpu.md): SGLANG_USE_CPU_ENGINE=1 and --device
cpu take SGLang's non-AMX x86 path, dense layers as plain torch operations
(srt/utils/common.py about L1073-1081); --attention-backend torch_native and
--sampling-backend pytorch are its backends without compiled kernels;
--disable-overlap-schedule keeps one batch at a time; --sleep-on-idle stops the idle scheduler
spinning on a core (arg_groups/fields/device.py L74, scheduler.py maybe_sleep_on_idle), which
on a 2-core machine would halve everything else. The launcher's scheduler and detokenizer die
with it (srt/utils/common.py kill_itself_when_parent_died), and the launcher with the process
that started it (rollouts.router.exiting_with_parent), so a killed test run leaves none behind.
One torch thread (OMP_NUM_THREADS=1 unless set): the tests' models are tiny and the two cores
are shared with the trainer, where spinning OpenMP threads made 3 x 64 requests of 40 tokens
take 4.05 s instead of 1.96 s beside two busy processes.
"""

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from rollouts import router

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.environ.get("LONGRL_SGLANG_PYTHON", os.path.join(ROOT, ".venv-sglang/bin/python"))
SHM = "/dev/shm"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
             "pytorch", "--disable-overlap-schedule", "--sleep-on-idle")


def _shared_memory() -> set[str]:
  """The names of the files in /dev/shm (none where there is no /dev/shm)."""
  return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """One `python -m sglang.launch_server` on 127.0.0.1 serving `model_path` (float32,
  --context-length `context_length`, `extra` flags after ours) at `url`, up once `wait()`
  returns (the constructor waits unless `wait=False`: start several, then wait for each;
  SGLang refuses connections while it loads, then answers 503 until its warm-up request is
  done, http_server.py L735-736). Its output goes to `log` (default: a file of its own in
  TMPDIR, removed when it stops). Start it from a thread that outlives it
  (rollouts.router.exiting_with_parent)."""

  def __init__(self, model_path: str, *, context_length: int = 1024, extra=(),
               log: str | None = None, timeout: float = 300.0, wait: bool = True):
    if not os.path.exists(PYTHON):
      raise RuntimeError(f"no SGLang environment at {PYTHON}: run bash scripts/setup_sglang.sh "
                         "(scripts/test.sh does)")
    port = free_port()
    self.url = f"http://127.0.0.1:{port}"
    # A log of our own is removed by stop(); a failure to start carries its end.
    self.own_log = log is None
    self.log = log or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"longrl-sglang-{port}-{os.getpid()}.log")
    command = [PYTHON, "-m", "sglang.launch_server", "--model-path", model_path, *CPU_FLAGS,
               "--dtype", "float32", "--context-length", str(context_length),
               "--max-total-tokens", str(max(8192, 4 * context_length)),
               "--host", "127.0.0.1", "--port", str(port), *extra]
    self.shm_before = _shared_memory()
    with open(self.log, "w") as out:
      self.process = subprocess.Popen(
          router.exiting_with_parent(command), stdout=out, stderr=subprocess.STDOUT,
          start_new_session=True, cwd=ROOT,
          env={"OMP_NUM_THREADS": "1", **os.environ, "SGLANG_USE_CPU_ENGINE": "1",
               "PYTHONUNBUFFERED": "1"})
    self.timeout = timeout
    if wait:
      self.wait()

  def wait(self) -> None:
    """Until /health answers 200 (at most the constructor's `timeout` s from now); stopped,
    with RuntimeError or TimeoutError holding the end of its log, if it does not."""
    try:
      self._wait_until_healthy(self.timeout)
    except BaseException:
      self.stop()
      raise

  def _wait_until_healthy(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
      if self.process.poll() is not None:
        raise RuntimeError(f"SGLang exited with code {self.process.returncode} before serving:"
                           f"\n{self.tail()}")
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=30):
          return
      except (urllib.error.URLError, ConnectionError, TimeoutError):  # HTTPError: 503
        pass
      if time.monotonic() > deadline:
        raise TimeoutError(f"SGLang at {self.url} not healthy within {timeout:.0f} s:\n"
                           f"{self.tail()}")
      time.sleep(0.25)

  def tail(self, lines: int = 40) -> str:
    with open(self.log, errors="replace") as f:
      return "".join(f.readlines()[-lines:])

  def alive(self) -> bool:
    """Whether any process of its group (launcher, scheduler, detokenizer) is left."""
    try:
      os.killpg(self.process.pid, 0)
      return True
    except ProcessLookupError:
      return False

  def stop(self, timeout: float = 30.0) -> None:
    """SIGKILL to its whole process group (launcher, scheduler, detokenizer: a test server
    has nothing to save, and SIGTERM takes the launcher about 7 s), then wait until the group
    is gone, at most `timeout` s."""
    try:
      os.killpg(self.process.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.process.wait(timeout=timeout)  # reaps the launcher, so that its group can empty
    deadline = time.monotonic() + timeout
    while self.alive():
      if time.monotonic() > deadline:
        raise TimeoutError(f"SGLang's processes (group {self.process.pid}) outlived SIGKILL "
                           f"by {timeout} s")
      time.sleep(0.05)
    self._remove_leftovers()

  def _remove_leftovers(self) -> None:
    """The shared-memory files SGLang leaves in /dev/shm when its processes die (its own CI
    sweeps them: srt/utils/stale_shm_cleanup.py): its load-snapshot slots and
    multiprocessing's semaphores that appeared since it started and no live process maps."""
    new = [n for n in _shared_memory() - self.shm_before
           if n.startswith(("sglang_loads_", "sem.mp-"))]
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/maps") as f:
          mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if SHM in line)
      except OSError:  # gone meanwhile, or not ours to read
        pass
    for name in new:
      if name not in mapped:
        try:
          os.remove(os.path.join(SHM, name))
        except FileNotFoundError:
          pass
    if self.own_log and os.path.exists(self.log):
      os.remove(self.log)
