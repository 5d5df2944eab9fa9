"""Runs every hostile program against one Sandbox and writes what happened as JSON.

tests/test_code_sandbox.py runs this script inside an outer pid (and mount) namespace, so
that a sandbox bug can at worst hurt that namespace, and checks the results and the host.
The script is that namespace's init: every process the sandboxes start is in it, orphans
are reparented to it, and its /proc lists them and nothing else on the machine, so what is
left once the sandboxes are closed is exactly what they failed to clean up.
Usage: python tests/sandbox_attacks.py OUT.json PLANTED_FILE ESCAPE_PATH
"""

import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl.verifiers.code import Limits, Sandbox  # noqa: E402

SECRET = "hunter2-longrl-secret"


def listener():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  server.settimeout(0.2)
  accepted = []
  stop = threading.Event()

  def loop():
    while not stop.is_set():
      try:
        accepted.append(server.accept()[0])
      except OSError:
        pass

  threading.Thread(target=loop, daemon=True).start()
  return server.getsockname()[1], accepted, stop


def leftover_processes(seconds: float = 5.0) -> list[int]:
  """Processes of this namespace but this script, once dead orphans are reaped; a killed
  sandbox takes a moment to exit, so wait up to `seconds` for none to be left."""
  deadline = time.monotonic() + seconds
  while True:
    try:
      while os.waitpid(-1, os.WNOHANG)[0]:
        pass
    except ChildProcessError:
      pass
    left = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
    if not left or time.monotonic() > deadline:
      return left
    time.sleep(0.05)


def main(out_path, planted, escape):
  os.environ["LONGRL_SECRET_TOKEN"] = SECRET  # the sandbox must not see it
  port, accepted, stop = listener()
  listing = "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
  cases = {
      "busy loop": "while True:\n  pass",
      "sleep": "import time\ntime.sleep(60)",
      "memory bomb": "x = bytearray(8 << 30)",
      "memory creep": "a = []\nwhile True:\n  a.append(' ' * 10**6)",
      "fork bomb": "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
      "thread bomb": ("import threading, time\nwhile True:\n"
                      "  threading.Thread(target=time.sleep, args=(60,)).start()"),
      "orphaned daemon": ("import os, time\nif os.fork() == 0:\n  os.setsid()\n"
                          "  if os.fork() == 0:\n    time.sleep(30)\n  os._exit(0)\n"
                          "print('parent done')"),
      "after daemon": listing,
      "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
      "after kill parent": "print('fresh')",
      "kill everything": "import os, signal\nos.kill(-1, signal.SIGKILL)",
      "after kill everything": listing,
      "write outside": (f"import os\nok = []\nfor path in [{escape!r}, '/usr/evil', "
                        f"'/bin/evil', '/proc/sys/kernel/hostname']:\n"
                        "  try:\n    open(path, 'w').write('x')\n    ok.append(path)\n"
                        "  except OSError:\n    pass\nprint(ok)"),
      "read host file": f"print(open({planted!r}).read())",
      "environment secrets": ("import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):"
                              "\n  try:\n    print(open(f'/proc/{p}/environ').read())\n"
                              "  except OSError:\n    pass"),
      "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
      "outside network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
      "stdout flood": "while True:\n  print('x' * 1000)",
      "stderr flood": "import sys\nwhile True:\n  sys.stderr.write('y' * 1000)",
  }
  # Only the programs that run until the wall clock ends them get a short one; the others
  # must reach their own limit, and on a loaded machine the memory creep alone took over 1.5 s.
  clock_cases = ("busy loop", "sleep", "fork bomb")
  results = {}
  for wall, names in ((1.5, clock_cases), (30.0, [n for n in cases if n not in clock_cases])):
    with Sandbox(Limits(wall_seconds=wall, memory_bytes=256 << 20, pids=16)) as sandbox:
      for name in names:
        outcome = sandbox.run(cases[name])
        results[name] = {k: outcome[k][-2000:] if isinstance(outcome[k], str) else outcome[k]
                         for k in ("status", "stdout", "stderr")}
  results["restarts"] = sandbox.restarts  # the second sandbox's: it ran the kills
  results["leftover processes"] = leftover_processes()
  stop.set()
  results["accepted connections"] = len(accepted)
  results["secret"] = SECRET
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:4])
