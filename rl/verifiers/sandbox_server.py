"""The fork server that runs inside the sandbox (its source is passed to `python3 -I -c`).

Owns running one untrusted program at a time: fork a child, give it a fresh working
directory, rlimits and its own session, run the source in-process (no interpreter start-up
per program, which is what makes many small programs per second possible), relay stdin,
stdout/stderr (one byte cap across both) and function calls, enforce the wall clock, then
kill every process the program left behind and wipe the scratch space. It speaks JSON lines
on fds 0/1 with rl/verifiers/code.py and imports nothing outside the standard library.

A run's verdict comes from how the child ended: a signal (timeout or killed), exit status 0
("ok") or any other status ("runtime error"). A syntax error and running out of memory are
told apart by a word the child writes on a pipe of its own before it exits, never by the
status, which the program chooses (`sys.exit(3)`, `os._exit(4)`). Calls name a function
("add"), a method of a fresh instance ("Solution.twoSum") or a class, whose new instance
stays in the child under the number the host gave it until the run ends; later calls name
that number and a method (`answer`). Only plain values go back, never an instance.

Inside a pid namespace (`--pidns`), clean-up is `kill(-1)`: every process but this one and
the namespace's init. Without one it only kills the child's process group, so a program
that calls setsid() can outlive its run: that is the weaker fallback.
"""

import builtins
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

EXIT_RUNTIME = 1
REPORTED = ("syntax error", "memory")  # the verdicts the child reports on its pipe
SCRATCH = os.environ.get("SANDBOX_SCRATCH", "/tmp")
PIDNS = "--pidns" in sys.argv

# Warm the modules programs import most, once, so each forked child starts with them.
for _module in ("collections", "functools", "heapq", "itertools", "math", "re", "string",
                "bisect", "fractions", "random", "statistics", "decimal", "copy", "typing",
                "dataclasses", "operator", "datetime", "json"):
  __import__(_module)


def encode(value, depth=0):
  """A JSON tree for plain Python values only; anything else (a subclass included) raises.
  The host (rl/verifiers/code.py) imports this and `decode` for the other direction."""
  if depth > 100:
    raise TypeError("value nested too deeply")
  t = type(value)
  if value is None or t is bool or t is str:
    return value
  if t is int:
    return {"i": str(value)}
  if t is float:
    return {"f": repr(value)}
  if t is complex:
    return {"c": [repr(value.real), repr(value.imag)]}
  if t is list:
    return [encode(v, depth + 1) for v in value]
  if t is tuple:
    return {"t": [encode(v, depth + 1) for v in value]}
  if t is dict:
    return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
  if t is set or t is frozenset:
    return {"s" if t is set else "fs": [encode(v, depth + 1) for v in value]}
  raise TypeError(f"an object of type {t.__name__}, not a plain value (None, bool, int, "
                  "float, complex, str, or lists, tuples, dicts and sets of them)")


def decode(tree, depth=0):
  """The plain value `encode` made `tree` from; ValueError for anything else. The host
  decodes what the program may have written itself, hence the same depth bound."""
  if depth > 100:
    raise ValueError("encoded value nested too deeply")
  if tree is None or isinstance(tree, (bool, str)):
    return tree
  if isinstance(tree, list):
    return [decode(v, depth + 1) for v in tree]
  if not isinstance(tree, dict) or len(tree) != 1:
    raise ValueError("malformed encoded value")
  (key, inner), = tree.items()
  if key == "i":
    return int(inner)
  if key == "f":
    return float(inner)
  if key == "c":
    return complex(float(inner[0]), float(inner[1]))
  if key == "t":
    return tuple(decode(v, depth + 1) for v in inner)
  if key == "d":
    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in inner}
  if key in ("s", "fs"):
    items = {decode(v, depth + 1) for v in inner}
    return items if key == "s" else frozenset(items)
  raise ValueError(f"cannot decode {key!r}")


def send(message):
  os.write(1, (json.dumps(message) + "\n").encode())


_inbox = b""


def receive(timeout=None):
  """The next JSON line from the host; None on end of file or timeout."""
  global _inbox
  deadline = None if timeout is None else time.monotonic() + timeout
  while b"\n" not in _inbox:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not select.select([0], [], [], wait)[0]:
      return None
    chunk = os.read(0, 1 << 20)
    if not chunk:
      sys.exit(0)
    _inbox += chunk
  line, _inbox = _inbox.split(b"\n", 1)
  return json.loads(line)


def child(request, workdir, fds):
  """Runs in the forked child: never returns."""
  stdin_r, out_w, err_w, call_r, result_w, verdict_w = fds
  try:
    os.setsid()
    os.chdir(workdir)
    os.dup2(stdin_r, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    keep = {0, 1, 2, verdict_w} | ({call_r, result_w} if request["mode"] == "call" else set())
    for fd in range(3, 256):
      if fd not in keep:
        try:
          os.close(fd)
        except OSError:
          pass
    limits = request["limits"]
    cpu = int(limits["cpu_seconds"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("nproc"):
      resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["solution.py"]
  except BaseException:
    os._exit(EXIT_RUNTIME)
  try:
    code = compile(request["src"], "solution.py", "exec")
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    traceback.print_exc(limit=0)
    sys.stderr.flush()
    report_and_exit(verdict_w, "syntax error")
  namespace = {"__name__": "__main__" if request["mode"] == "stdio" else "solution",
               "__builtins__": builtins}
  status, verdict = 0, None
  try:
    exec(code, namespace)
    if request["mode"] == "call":
      serve_calls(namespace, call_r, result_w)
  except SystemExit as e:
    # Any status but 0 (256 included, which the kernel would truncate to 0) is a failure;
    # type() rather than ==, which the program's own class could redefine to raise here.
    if not (e.code is None or (type(e.code) in (int, bool) and e.code == 0)):
      status = EXIT_RUNTIME
      try:  # the message of sys.exit("message"), as the interpreter prints it
        if type(e.code) not in (int, bool):
          print(e.code, file=sys.stderr)
      except BaseException:
        pass
  except MemoryError:
    verdict = "memory"
  except BaseException as e:
    try:  # the program's frames only, not this server's
      traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    except BaseException:
      pass
    status = EXIT_RUNTIME
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:
    pass
  if verdict is not None:
    report_and_exit(verdict_w, verdict)
  os._exit(status)


def report_and_exit(verdict_w, verdict):
  """Tell the server a verdict that an exit status cannot carry, then exit as failed."""
  try:
    os.write(verdict_w, verdict.encode())
  except OSError:
    pass
  os._exit(EXIT_RUNTIME)


def resolve(namespace, name):
  """What a call names: a module-level function or class, or "Class.method" on a fresh
  instance, as LeetCode's judge calls `Solution().twoSum(...)` (one instance per call)."""
  owner, _, method = name.rpartition(".")
  if owner:
    cls = namespace.get(owner)
    if not isinstance(cls, type):
      raise NameError(f"the program defines no class {owner!r}")
    function = getattr(cls(), method, None)
  else:
    function = namespace.get(name)
  if not callable(function):
    kind = "function" if owner else "function or class"
    raise NameError(f"the program defines no {kind} {name!r}")
  return function


def answer(namespace, instances, call):
  """The reply to one call, {"value": encoded plain result} or {"handle": n}.
  {"name", "args", "handle": n}: the function `name` resolves to, or for a class the
  program defines, a new instance kept as instances[n] (n is the host's number for it).
  {"on": n, "name", "args"}: the method `name` of instances[n].
  The checks here give a failing test its reason; the guarantee is the host's, which
  decodes plain values only and numbers handles itself, whatever the program sends."""
  args = decode(call["args"])
  if "on" in call:
    instance = instances[call["on"]]
    label = f"{type(instance).__name__}.{call['name']}"
    method = getattr(instance, call["name"])
    if not callable(method):
      raise TypeError(f"{label} is an attribute of type {type(method).__name__}, not a "
                      "method; only method calls reach an instance")
    return plain_reply(label, method(*args))
  target = resolve(namespace, call["name"])
  if not isinstance(target, type):
    return plain_reply(call["name"], target(*args))
  if target.__module__ != namespace["__name__"]:  # e.g. a class it imported
    raise TypeError(f"{call['name']} is {target.__module__}.{target.__qualname__}, not a "
                    "class the program defines")
  instances[call["handle"]] = target(*args)
  return {"handle": call["handle"]}


def plain_reply(label, value):
  try:
    return {"value": encode(value)}
  except TypeError as e:
    raise TypeError(f"{label} returned {e}") from None


def serve_calls(namespace, call_r, result_w):
  reader = os.fdopen(call_r, "r")
  instances = {}  # the instances calls made, by the host's number; gone with the child
  for line in reader:
    try:
      reply = answer(namespace, instances, json.loads(line))
    except MemoryError:
      raise
    except Exception as e:
      reply = {"error": f"{type(e).__name__}: {e}"[:500]}
    os.write(result_w, (json.dumps(reply) + "\n").encode())
  sys.exit(0)


def clean_up(pid):
  """Kill what the run left behind and wipe the scratch space."""
  try:
    if PIDNS:
      os.kill(-1, signal.SIGKILL)
    else:
      os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  while True:
    try:
      if os.waitpid(-1, 0)[0] == 0:
        break
    except ChildProcessError:
      break
  if PIDNS:
    # Orphans (a daemon that forked away) belong to the namespace's init, which reaps them
    # in its own time: on a loaded machine the next run still saw their zombies. Wait (at
    # most a second) until only init and this server are left.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(
        entry.isdigit() and int(entry) not in (1, os.getpid()) for entry in os.listdir("/proc")):
      time.sleep(0.001)
  for entry in os.listdir(SCRATCH):
    path = os.path.join(SCRATCH, entry)
    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


class _Session:
  """One program's pipes as the server reads and writes them: its output (counted against
  the output limit), its stdin (written as it drains), and in call mode the requests relayed
  to it and the results relayed back. `verdict` becomes set once the run must end early."""

  def __init__(self, request, limits, fds):
    self.out_r, self.err_r, self.stdin_w, self.call_w, self.result_r = fds
    self.limit = limits["output_bytes"]
    self.buffers = {self.out_r: bytearray(), self.err_r: bytearray()}
    self.open_fds = {self.out_r, self.err_r}
    self.total, self.verdict = 0, None
    self.pending_stdin = request.get("stdin", "").encode()
    if not self.pending_stdin:
      os.close(self.stdin_w)
      self.stdin_w = None
    self.call_mode = request["mode"] == "call"
    self.results, self.in_call = bytearray(), False
    self.result_open = self.call_mode

  def drain(self, fd) -> None:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      self.open_fds.discard(fd)
      return
    self.buffers[fd] += chunk
    self.total += len(chunk)
    if self.total > self.limit:
      self.verdict = "output limit"

  def drain_buffered(self) -> None:
    """What the pipes hold now (the program exited; a daemon holding them must not keep us):
    its output, and in call mode a reply it wrote just before exiting, relayed as any other
    (the loop may see the exit before it sees the reply)."""
    while self.verdict is None:
      pipes = list(self.open_fds) + ([self.result_r] if self.result_open else [])
      ready = select.select(pipes, [], [], 0)[0] if pipes else []
      if not ready:
        return
      for fd in ready:
        self.read(fd)

  def readers(self, exited) -> list:
    readers = list(self.open_fds) + [exited]
    if self.result_open:
      readers.append(self.result_r)
    if self.call_mode and not self.in_call:
      readers.append(0)
    return readers

  def write_stdin(self) -> None:
    try:
      written = os.write(self.stdin_w, self.pending_stdin[:1 << 16])
      self.pending_stdin = self.pending_stdin[written:]
    except BrokenPipeError:
      self.pending_stdin = b""
    if not self.pending_stdin:
      os.close(self.stdin_w)
      self.stdin_w = None

  def read(self, fd) -> None:
    """`fd` is readable: a call request from the client (0), a result from the program, or
    its output."""
    if fd == 0:
      message = receive(0)
      if message is None:
        return
      if message["op"] == "end":
        self.verdict = "ended"
        return
      try:
        os.write(self.call_w, (json.dumps(message) + "\n").encode())
        self.in_call = True
      except BrokenPipeError:  # it exited; the loop reports how
        pass
    elif fd == self.result_r:
      chunk = os.read(self.result_r, 1 << 20)
      if not chunk:  # the program closed it: an end-of-file pipe would stay readable
        self.result_open = False
        return
      self.results += chunk
      while b"\n" in self.results:
        line, _, rest = bytes(self.results).partition(b"\n")
        self.results = bytearray(rest)
        # The program can write on this pipe itself: a line relayed as it is could be a
        # "final" or "ready" of ours, and the host would take the server to be free.
        if not self.in_call or not is_reply(line):
          self.buffers[self.err_r] += b"\nthe program wrote on the call pipe out of turn\n"
          self.verdict = "runtime error"
          return
        os.write(1, line + b"\n")
        self.in_call = False
    else:
      self.drain(fd)

  def output(self, fd) -> str:
    return bytes(self.buffers[fd][:self.limit]).decode("utf-8", "replace")


def is_reply(line) -> bool:
  """Whether `line` is a reply as `serve_calls` writes it: a JSON object of one key, "value",
  "handle" or "error"."""
  try:
    reply = json.loads(line)
  except (ValueError, RecursionError):
    return False
  return type(reply) is dict and len(reply) == 1 and next(iter(reply)) in (
      "value", "handle", "error")


def _verdict(verdict, exit_status, reported) -> str:
  """The run's status from how it ended: early (a verdict), or by the program's exit, where
  `reported` is what the child wrote on its verdict pipe (only believed after a failure)."""
  if verdict == "ended":
    return "ok"
  if verdict is not None:
    return verdict
  if os.WIFSIGNALED(exit_status):
    return "timeout" if os.WTERMSIG(exit_status) == signal.SIGXCPU else "killed"
  if os.WEXITSTATUS(exit_status) == 0:
    return "ok"
  return reported if reported in REPORTED else "runtime error"


def _reported(verdict_r) -> str:
  """What the child wrote on its verdict pipe; a daemon holding the pipe must not block us."""
  if not select.select([verdict_r], [], [], 0)[0]:
    return ""
  return os.read(verdict_r, 64).decode("utf-8", "replace")


def run(request):
  limits = request["limits"]
  workdir = os.path.join(SCRATCH, "work")
  os.mkdir(workdir, 0o700)
  stdin_r, stdin_w = os.pipe()
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  call_r, call_w = os.pipe()
  result_r, result_w = os.pipe()
  verdict_r, verdict_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    child(request, workdir, (stdin_r, out_w, err_w, call_r, result_w, verdict_w))
  for fd in (stdin_r, out_w, err_w, call_r, result_w, verdict_w):
    os.close(fd)
  start = time.monotonic()
  deadline = start + limits["wall_seconds"]
  session = _Session(request, limits, (out_r, err_r, stdin_w, call_w, result_r))
  exit_status = None
  if session.call_mode:
    send({"ready": True})
  exited = os.pidfd_open(pid)  # readable once the child exits: no polling
  while session.verdict is None:
    waited, status = os.waitpid(pid, os.WNOHANG)
    if waited:
      exit_status = status
      session.drain_buffered()
      break
    timeout = deadline - time.monotonic()
    if timeout <= 0:
      session.verdict = "timeout"
      break
    writers = [session.stdin_w] if session.stdin_w is not None else []
    ready_r, ready_w, _ = select.select(session.readers(exited), writers, [], timeout)
    if ready_w:
      session.write_stdin()
    for fd in ready_r:
      if fd != exited and session.verdict is None:
        session.read(fd)
  if exit_status is None:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    _, exit_status = os.waitpid(pid, 0)
  seconds = time.monotonic() - start
  reported = _reported(verdict_r)
  for fd in (out_r, err_r, call_w, result_r, session.stdin_w, exited, verdict_r):
    if fd is not None:
      os.close(fd)
  clean_up(pid)
  send({"final": True, "status": _verdict(session.verdict, exit_status, reported),
        "seconds": seconds, "stdout": session.output(out_r), "stderr": session.output(err_r)})


def main():
  # SIGPIPE stays ignored (Python's default, which the program inherits too): a program may
  # exit before reading all its stdin or before a relayed call, and writing to it then must
  # raise BrokenPipeError here, not kill the server.
  send({"ready": True, "pid": os.getpid()})
  while True:
    request = receive()
    if request is None:
      return
    if request.get("op") == "run":  # a call that raced the program's exit is dropped
      run(request)


if __name__ == "__main__":
  main()
