"""Sandboxed execution of model-written Python against stdin/stdout tests or assert tests.

Owns isolation, limits and verdicts for untrusted code. It does not own datasets
(rl/tasks/code.py) or rewards.

Isolation (`isolation="bwrap"`, the default wherever bubblewrap exists): each `Sandbox` is a
fork server (rl/verifiers/sandbox_server.py) inside bubblewrap with new user, pid, network,
mount, ipc and uts namespaces; it runs as uid 65534 (the host process drops to `nobody`
first when it is root), sees only read-only /usr, /lib, /lib64 and /bin, a private tmpfs
/tmp for its working directory, a fresh /proc and /dev, an empty environment, and no network
but its own loopback. The whole tree sits in a cgroup with a pids and a memory limit where
the host allows one (v1 or v2); every program also gets rlimits (address space, CPU seconds,
file size, open files, core dumps, processes). A run ends at its wall-clock limit, its output
cap (stdout and stderr together) or its exit, and then every process in the namespace but
the server is killed and /tmp wiped, so nothing outlives a run. A program that kills the
server ends its own run as "killed" and the sandbox is started afresh.

`isolation="none"` is the weaker fallback used (with a warning) where bubblewrap is missing:
the same server as a plain subprocess with an empty environment, its own session, rlimits
and a temporary working directory, but with the host's file system, network and uid, and
only the program's process group killed at the end. Install bubblewrap
(`apt-get install bubblewrap`) before running code you do not trust.

Tests never enter the sandbox. Stdin/stdout tests compare the captured stdout outside.
Assert tests run on the host against a proxy: each call of the tested function (or of a
method of a fresh instance, LeetCode's `Solution().twoSum`) is sent to the sandbox, its
result comes back as plain values only (int, float, str, bool, None and lists, tuples,
dicts, sets of them; subclasses refused), and the assert is evaluated on the host. An
always-equal object, sys.exit(0) before the asserts, a printed "passed" or a look for the
test file therefore cannot pass. Any exit status but 0 is a runtime error.

Tests may construct the program's classes themselves (`Solution().twoSum(...)`, or
`obj = MinStack(); obj.push(3); assert obj.getMin() == 3`): a name the tests call that they,
their setup and the builtins leave unbound is the program's, and calling its class makes
the instance in the sandbox, where it stays until the run ends, and gives the host a
handle numbered by the host. The handle only carries method calls: their arguments and
results are plain values like any call's; a method returning an object, a handle passed
as an argument, reading an attribute, comparing a handle or testing its truth, a class the
program imported, and a call once the run has ended are all refused with what was wrong.
The fork server relays only well-formed replies, in turn, so a program that writes on its
call pipe cannot forge the end of its run or a handle.
"""

import ast
import builtins
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Sequence

from rl.verifiers.sandbox_server import decode, encode

STATUSES = ("accepted", "wrong answer", "runtime error", "syntax error", "timeout", "memory",
            "output limit", "killed")
_SERVER_SOURCE = pathlib.Path(__file__).with_name("sandbox_server.py").read_text()
_NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_seconds: float = 5.0  # the whole run, calls included
  memory_bytes: int = 512 << 20  # address space per process; also the cgroup limit
  pids: int = 32  # processes and threads of the whole sandbox
  output_bytes: int = 1 << 16  # stdout and stderr together
  file_bytes: int = 16 << 20


@dataclasses.dataclass(frozen=True)
class StdioTest:
  stdin: str
  expected_stdout: str


@dataclasses.dataclass(frozen=True)
class TestResult:
  status: str  # one of STATUSES
  detail: str = ""  # stderr tail, the failing assert or the call's error

  @property
  def passed(self) -> bool:
    return self.status == "accepted"


class SandboxError(RuntimeError):
  """The sandbox itself could not be started (not a verdict on the program)."""


def bwrap_available() -> bool:
  return shutil.which("bwrap") is not None


def _interpreter() -> str:
  # Debian's interpreter lives under /usr, which the sandbox binds read-only.
  return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class _Cgroup:
  """A pids + memory cgroup for one sandbox, v1 or v2; `path_args` is empty when the host
  does not let us create one (then the rlimits are the only limit)."""

  def __init__(self, name: str, limits: Limits):
    self.dirs: list[pathlib.Path] = []
    try:
      own = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
      return
    v1 = {}
    for line in own:
      _, controllers, path = line.split(":", 2)
      for controller in controllers.split(","):
        v1[controller] = path
    if "pids" in v1 and "memory" in v1 and pathlib.Path("/sys/fs/cgroup/pids").is_dir():
      plan = [(pathlib.Path("/sys/fs/cgroup/pids") / v1["pids"].lstrip("/") / name,
               {"pids.max": limits.pids + 2}),
              (pathlib.Path("/sys/fs/cgroup/memory") / v1["memory"].lstrip("/") / name,
               {"memory.limit_in_bytes": limits.memory_bytes, "memory.swappiness": 0})]
    elif "" in v1:
      plan = [(pathlib.Path("/sys/fs/cgroup") / v1[""].lstrip("/") / name,
               {"pids.max": limits.pids + 2, "memory.max": limits.memory_bytes,
                "memory.swap.max": 0})]
    else:
      return
    try:
      for directory, settings in plan:
        directory.mkdir()
        self.dirs.append(directory)
        for key, value in settings.items():
          (directory / key).write_text(str(value))
    except OSError:
      self.remove()

  def enter_command(self) -> str:
    """Shell prefix that moves the shell into the cgroup before it execs the sandbox."""
    return "".join(f"echo $$ > {d}/cgroup.procs && " for d in self.dirs)

  def remove(self):
    for directory in self.dirs:
      try:
        for pid in (directory / "cgroup.procs").read_text().split():
          os.kill(int(pid), 9)
      except OSError:
        pass
      for _ in range(50):
        try:
          directory.rmdir()
          break
        except OSError:
          time.sleep(0.02)
    self.dirs = []


def _real_root() -> bool:
  """Root of the host (not of a user namespace): rlimits on processes do not bind it, so
  the sandbox is started as `nobody` instead."""
  if os.geteuid() != 0:
    return False
  try:
    first = pathlib.Path("/proc/self/uid_map").read_text().split("\n")[0].split()
  except OSError:
    return True
  return first[:3] == ["0", "0", "4294967295"]


def _command(isolation: str) -> list[str]:
  python = [_interpreter(), "-I", "-c", _SERVER_SOURCE]
  if isolation == "none":
    return python
  binds = []
  for path in ("/usr", "/lib", "/lib64", "/bin"):
    if os.path.exists(path):
      binds += ["--ro-bind", path, path]
  prefix = sys.base_prefix
  if not _interpreter().startswith("/usr/") and not prefix.startswith("/usr"):
    binds += ["--ro-bind", prefix, prefix]
  bwrap = ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(_NOBODY),
           "--gid", str(_NOBODY), "--die-with-parent", "--new-session", "--hostname", "sandbox",
           *binds, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp",
           "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--cap-drop", "ALL"]
  command = bwrap + python + ["--pidns"]
  if _real_root() and shutil.which("setpriv"):
    command = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups",
               "--inh-caps=-all"] + command
  return command


class _CallFailed(Exception):
  def __init__(self, status: str, detail: str):
    super().__init__(detail)
    self.status, self.detail = status, detail


class Sandbox:
  """One fork server; runs one program at a time. Thread-compatible, not thread-safe."""

  def __init__(self, limits: Limits = Limits(), *, isolation: str = "auto"):
    if isolation == "auto":
      isolation = "bwrap" if bwrap_available() else "none"
    if isolation not in ("bwrap", "none"):
      raise ValueError(f"Sandbox: isolation={isolation!r}; valid: 'auto', 'bwrap', 'none'")
    if isolation == "bwrap" and not bwrap_available():
      raise SandboxError("Sandbox: isolation='bwrap' but bubblewrap is not installed "
                         "(apt-get install bubblewrap)")
    if isolation == "none":
      warnings.warn("Sandbox: bubblewrap is not available; model-written code runs without "
                    "namespace isolation (host files, network and uid are reachable). "
                    "Install bubblewrap for untrusted code.", RuntimeWarning, stacklevel=2)
    self.limits, self.isolation = limits, isolation
    self._process = None
    self._cgroup = None
    self._scratch = None
    self._inbox = b""
    self._running = False  # a run was sent and its final message not yet received
    self.restarts = 0

  # --- process management

  def _start(self):
    name = f"longrl-sandbox-{os.getpid()}-{id(self)}-{self.restarts}"
    env = {"PATH": "/usr/bin:/bin"}
    if self.isolation == "none":
      self._scratch = tempfile.mkdtemp(prefix="longrl-sandbox-")
      env["SANDBOX_SCRATCH"] = self._scratch
    self._cgroup = _Cgroup(name, self.limits)
    command = _command(self.isolation)
    shell = self._cgroup.enter_command() + 'exec "$@"'
    self._process = subprocess.Popen(["/bin/sh", "-c", shell, "sh", *command],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, start_new_session=True,
                                     cwd=self._scratch or "/")
    self._inbox = b""
    hello = self._receive(time.monotonic() + 30)
    if hello is None or not hello.get("ready"):
      stderr = self._process.stderr.read1(4096).decode(errors="replace") \
          if self._process.poll() is not None else ""
      self._stop()
      raise SandboxError(f"Sandbox: the {self.isolation} fork server did not start: "
                         f"{stderr.strip() or 'no output'}")

  def _stop(self):
    if self._process is not None:
      try:
        os.killpg(self._process.pid, 9)
      except (ProcessLookupError, PermissionError):
        pass
      self._process.kill()
      self._process.wait()
      for stream in (self._process.stdin, self._process.stdout, self._process.stderr):
        stream.close()
      self._process = None
    if self._cgroup is not None:
      self._cgroup.remove()
    if self._scratch is not None:
      shutil.rmtree(self._scratch, ignore_errors=True)
      self._scratch = None

  def close(self):
    self._stop()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _send(self, message) -> bool:
    try:
      self._process.stdin.write((json.dumps(message) + "\n").encode())
      self._process.stdin.flush()
      return True
    except (BrokenPipeError, OSError, ValueError):
      return False

  def _receive(self, deadline: float):
    """The next message from the server, or None if it died or missed `deadline`."""
    fd = self._process.stdout.fileno()
    while b"\n" not in self._inbox:
      wait = deadline - time.monotonic()
      if wait <= 0 or not select.select([fd], [], [], wait)[0]:
        return None
      chunk = os.read(fd, 1 << 20)
      if not chunk:
        return None
      self._inbox += chunk
    line, self._inbox = self._inbox.split(b"\n", 1)
    message = json.loads(line)
    if message.get("final"):
      self._running = False
    return message

  def _begin(self, src: str, stdin: str, mode: str):
    if self._process is None or self._process.poll() is not None:
      self._stop()
      self._start()
    nproc = self.limits.pids * 4 if self.isolation == "bwrap" else 0
    limits = {"wall_seconds": self.limits.wall_seconds, "cpu_seconds":
              math.ceil(self.limits.wall_seconds), "memory_bytes": self.limits.memory_bytes,
              "output_bytes": self.limits.output_bytes, "file_bytes": self.limits.file_bytes,
              "nproc": nproc}
    self._send({"op": "run", "src": src, "stdin": stdin, "mode": mode, "limits": limits})
    self._running = True
    # The server enforces the wall clock; this host-side bound only catches a server that
    # the program stopped (a killed one closes the pipe at once). It is generous: on a
    # loaded machine, reaping a thread bomb's thousands of threads took over 5 s.
    return time.monotonic() + self.limits.wall_seconds + 30.0

  def _final(self, deadline: float) -> dict:
    message = self._receive(deadline)
    while message is not None and not message.get("final"):
      message = self._receive(deadline)
    if message is None:  # the program killed or stopped the server
      self._running = False
      self._stop()
      self.restarts += 1
      return {"status": "killed", "stdout": "", "stderr": "the sandbox server was killed"}
    return message

  # --- the two kinds of test

  def run(self, src: str, stdin: str = "") -> dict:
    """Run `src` as a script once: {"status", "stdout", "stderr", "seconds"}, where status
    is "ok" or a failure from STATUSES."""
    return self._final(self._begin(src, stdin, "stdio"))

  def run_stdio_tests(self, src: str, tests: Sequence[StdioTest]) -> list[TestResult]:
    results = []
    for test in tests:
      outcome = self.run(src, test.stdin)
      if outcome["status"] != "ok":
        results.append(TestResult(outcome["status"], outcome["stderr"][-500:]))
      elif _same_output(outcome["stdout"], test.expected_stdout):
        results.append(TestResult("accepted"))
      else:
        results.append(TestResult("wrong answer", outcome["stdout"][-200:]))
    return results

  def run_assert_tests(self, src: str, tests: Sequence[str], *, entry_point: str,
                       setup: str = "") -> list[TestResult]:
    """Each test is trusted Python run on the host (e.g. "assert f(2) == 4" or a HumanEval
    `check(candidate)` call) where `entry_point` and `candidate` stand for the program's
    function; `setup` is trusted code run first in the same host namespace (a dataset's
    helpers, a HumanEval prompt's other functions and the check function). A dotted
    `entry_point` ("Solution.twoSum") calls that method of a fresh instance of the class, as
    LeetCode does; the tests call it as `candidate` or by the method's name. A name the tests
    or `setup` call that neither they, `setup` nor the builtins bind is the program's: its
    function, or its class, which gives a `_Handle` (`Solution().twoSum(...)`,
    `s = MinStack(); s.push(3)`)."""
    deadline = self._begin(src, "", "call")
    ready = self._receive(deadline)
    if ready is None or ready.get("final"):
      outcome = ready or self._final(deadline)
      status = outcome["status"]
      if status == "ok":  # it exited before a single test ran
        status, outcome["stderr"] = "runtime error", "the program exited before the tests ran"
      return [TestResult(status, outcome["stderr"][-500:])] * len(tests)
    calls = _Calls(self, deadline)
    try:
      return self._judge(tests, calls, entry_point, setup)
    finally:  # also when a test raises what no verdict covers: the server must leave the run
      calls.ended = True
      if self._running:
        self._send({"op": "end"})
        self._final(deadline)

  def _judge(self, tests: Sequence[str], calls: "_Calls", entry_point: str,
             setup: str) -> list[TestResult]:
    """One TestResult per test, each run in a fresh namespace (`_test_namespace`)."""
    program_names = _called_names([setup, *tests])
    results, finished = [], None
    for test in tests:
      if finished is not None:
        results.append(finished)
        continue
      try:
        exec(test, _test_namespace(setup, calls, entry_point, program_names))
        results.append(TestResult("accepted"))
      except _CallFailed as e:
        results.append(TestResult(e.status, e.detail))
        if not self._running:  # the program ended (exited, raised, was killed): no more calls
          finished = TestResult(e.status, e.detail)
      # A NameError is not caught: the program cannot cause one on the host (every name the
      # tests call is bound), so it is a test the sandbox cannot run, and must not score 0.
      except (AssertionError, TypeError, ValueError, KeyError, IndexError, AttributeError,
              ArithmeticError) as e:
        results.append(TestResult("wrong answer", f"{type(e).__name__}: {e}"[:300]))
    return results

  def _call(self, message: dict, deadline: float) -> dict:
    """Send one call to the running program: its reply, {"value": tree} or {"handle": n};
    _CallFailed when the call raised there or the program ended."""
    if not self._send(message):
      raise _CallFailed("killed", "the sandbox server was killed")
    reply = self._receive(deadline)
    if reply is None or reply.get("final"):
      outcome = reply or self._final(deadline)
      raise _CallFailed(outcome["status"] if outcome["status"] != "ok" else "runtime error",
                        outcome["stderr"][-500:] or "the program exited during a test")
    if "error" in reply:
      raise _CallFailed("runtime error", reply["error"])
    return reply


def _called_names(sources: Sequence[str]) -> frozenset[str]:
  """The names called as `name(...)` anywhere in `sources` (Python text)."""
  names = set()
  for source in sources:
    try:
      tree = ast.parse(source)
    except SyntaxError:
      continue  # exec reports it
    names.update(node.func.id for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name))
  return frozenset(names)


def _test_namespace(setup: str, calls: "_Calls", entry_point: str,
                    program_names: frozenset[str]) -> dict[str, Any]:
  """A fresh namespace for one test: each of `program_names` but the builtins' for the
  program's function or class of that name, then `setup` run in it, then the entry point's
  name and `candidate` for the entry point."""
  # A program class named `len` or `all` must not stand in for the builtin, nor one named
  # `returned` for setup's (`assert all(...)` would then test a handle, not the results):
  # builtins are skipped, and setup and the test, run after, rebind whatever they define.
  namespace: dict[str, Any] = {"__name__": "longrl_tests"}
  for name in program_names - builtins.__dict__.keys():
    namespace[name] = _Remote(calls, name)
  exec(setup, namespace)  # trusted: comes from the dataset, not the model
  namespace[entry_point.rpartition(".")[2]] = namespace["candidate"] = _Remote(calls,
                                                                             entry_point)
  return namespace


class _Calls:
  """The host's end of one run's calls. Arguments and results are plain values only
  (`encode`, `decode`); a class's instance stays in the sandbox and the host holds a
  `_Handle` on it, numbered here, never by the sandbox, so the program cannot forge one.
  Once the run is over (`ended`, or the program exited) every call is refused: the
  instances are gone, and the sandbox may already run another program."""

  def __init__(self, sandbox: Sandbox, deadline: float):
    self._sandbox, self._deadline = sandbox, deadline
    self._handles = 0  # handles made so far: the next one is numbered _handles + 1
    self.ended = False

  def call(self, name: str, args: tuple) -> Any:
    """The program's function `name` called with `args`: its plain result; or its class
    `name` constructed in the sandbox: a `_Handle` on the instance."""
    number = self._handles + 1
    reply = self._request({"op": "call", "name": name, "handle": number}, name, args)
    if "handle" not in reply:
      return _plain(reply, name)
    if reply["handle"] != number:
      raise _CallFailed("runtime error", f"{name}: the sandbox answered with handle "
                        f"{reply['handle']!r} where the host asked for #{number}")
    self._handles = number
    return _Handle(self, number, name)

  def call_method(self, handle: "_Handle", method: str, args: tuple) -> Any:
    """`method` of the handle's instance called with `args`: its plain result."""
    label = f"{handle!r}.{method}"
    return _plain(self._request({"op": "call", "on": handle._number, "name": method},
                                label, args), label)

  def _request(self, message: dict, label: str, args: tuple) -> dict:
    if self.ended or not self._sandbox._running:
      raise _CallFailed("runtime error", f"{label}: the run it belongs to has ended, and its "
                        "instances with it")
    try:
      message["args"] = encode(list(args))
    except TypeError as e:  # a handle among them: it stands for an instance, it is not one
      raise TypeError(f"{label} was given {e}") from None
    return self._sandbox._call(message, self._deadline)


def _plain(reply: dict, label: str) -> Any:
  if "value" not in reply:
    raise _CallFailed("runtime error", f"{label}: the sandbox replied {sorted(reply)} where "
                      "a value was due")
  return decode(reply["value"])


class _Opaque:
  """What the tests hold for something in the sandbox: only calling it reaches the sandbox.
  It has no truth value and no comparison (identity would make `assert x != y` pass, and
  truth `assert Solution()`), so an assert passes on the plain values calls return only."""
  __slots__ = ()
  _use = "call it"

  def _refuse(self, *_):
    raise TypeError(f"{self!r} stands for something in the sandbox and has no value on the "
                    f"host: {self._use}")

  __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
  __hash__ = None


class _Remote(_Opaque):
  """A name of the program (its function, its class or "Class.method"), called there."""
  __slots__ = ("_calls", "_name")

  def __init__(self, calls: _Calls, name: str):
    self._calls, self._name = calls, name

  def __call__(self, *args):
    return self._calls.call(self._name, args)

  def __repr__(self):
    return f"the program's {self._name}"


class _Handle(_Opaque):
  """An instance of the program's class, which lives in the sandbox: `handle.method(*args)`
  calls the method there and returns its plain result. Nothing else about the instance
  crosses: attribute values, comparisons, truth and the handle as an argument are refused."""
  # The host's own attributes are underscored, so none hides a method of the program's.
  __slots__ = ("_calls", "_number", "_class")
  _use = "call one of its methods"

  def __init__(self, calls: _Calls, number: int, class_name: str):
    for slot, value in (("_calls", calls), ("_number", number), ("_class", class_name)):
      object.__setattr__(self, slot, value)

  def __getattr__(self, name: str) -> "_Method":
    # Underscored names are refused, dunders above all: copy, pickle and IPython probe
    # `__deepcopy__`, `_repr_html_` and the like, which must not turn into calls.
    if name.startswith("_"):
      raise AttributeError(f"{self!r}.{name}: only public methods are called through a "
                           "handle")
    return _Method(self, name)

  def __setattr__(self, name, value):
    raise TypeError(f"{self!r}.{name} = ...: a handle's instance is changed by calling its "
                    "methods")

  def __repr__(self):
    return f"{self._class}#{self._number}"


class _Method(_Opaque):
  """`handle.name`, which is only ever called: reading it as a value is refused."""
  __slots__ = ("_handle", "_name")
  _use = "call it; attributes other than methods are not read from the sandbox"

  def __init__(self, handle: _Handle, name: str):
    self._handle, self._name = handle, name

  def __call__(self, *args):
    return self._handle._calls.call_method(self._handle, self._name, args)

  def __repr__(self):
    return f"{self._handle!r}.{self._name}"


def _same_output(actual: str, expected: str) -> bool:
  """Equal up to trailing whitespace on each line and trailing blank lines."""
  def lines(text):
    return [line.rstrip() for line in text.rstrip().splitlines()]
  return lines(actual) == lines(expected)


@dataclasses.dataclass(frozen=True)
class Job:
  """One program and its tests: stdio tests, or assert tests with their entry point."""
  src: str
  stdio_tests: tuple[StdioTest, ...] = ()
  assert_tests: tuple[str, ...] = ()
  entry_point: str = ""
  setup: str = ""


class CodeSandbox:
  """A pool of `workers` sandboxes; `run_batch(jobs)` runs jobs concurrently, one per
  sandbox at a time, and returns per-test results in job order."""

  def __init__(self, *, workers: int = 2, limits: Limits = Limits(), isolation: str = "auto"):
    self._idle = [Sandbox(limits, isolation=isolation) for _ in range(workers)]
    self._lock = threading.Lock()
    self._executor = concurrent.futures.ThreadPoolExecutor(workers)
    self.isolation = self._idle[0].isolation

  def _run(self, job: Job) -> list[TestResult]:
    with self._lock:
      sandbox = self._idle.pop()
    try:
      if job.assert_tests:
        return sandbox.run_assert_tests(job.src, job.assert_tests, entry_point=job.entry_point,
                                        setup=job.setup)
      return sandbox.run_stdio_tests(job.src, job.stdio_tests)
    finally:
      with self._lock:
        self._idle.append(sandbox)

  def run_batch(self, jobs: Sequence[Job]) -> list[list[TestResult]]:
    return list(self._executor.map(self._run, jobs))

  def close(self):
    self._executor.shutdown()
    for sandbox in self._idle:
      sandbox.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
