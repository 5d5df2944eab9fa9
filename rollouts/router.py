"""The real sglang-router (PyPI `sglang-router`, a Rust process) in front of a fleet of servers.

Owns starting it with the flags a trainer needs and registering workers with it; the routing,
health checks, retries and circuit breaking are the router's own. What it does with our
requests (sglang-router 0.3.2, checked against rollouts/server/):
- only /generate (and /flush_cache) goes through it; aborts, pause/continue, weight updates and
  /model_info answer 404 there, so SGLangClient sends those to every worker directly;
- with `--policy manual` a request's `X-SMG-Routing-Key` header pins it to one worker (the
  client sends its affinity key, so an episode's turns and a resumed trajectory reuse one
  server's prefix cache) and keys move to a live worker when theirs dies;
- a worker killed mid-request: the router re-sends the request, same rid, to another worker;
  health checks every second drop the dead one within ~2 s, and take it back (same URL) as soon
  as it answers /health again;
- every worker down: HTTP 500/503 from the router, which the client reports naming it.

  python -m sglang_router.launch_router --host 127.0.0.1 --port P --worker-urls U1 U2 \\
      --policy manual --assignment-mode min_group --health-check-interval-secs 1 ...

(`launch` below gives the whole line.)
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Sequence


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def command(worker_urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 30000,
            metrics_port: int = 29000) -> list[str]:
  """The router's command line. Its default retries stay on (a request on a dead worker is
  re-sent elsewhere), each attempt may take two hours (a long chain of thought must not be
  re-sent for running long), and a recovered worker is tried again after 5 s rather than 60."""
  return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
          str(port), "--worker-urls", *worker_urls, "--policy", "manual",
          "--assignment-mode", "min_group", "--health-check-interval-secs", "1",
          "--health-failure-threshold", "2", "--health-success-threshold", "1",
          "--cb-timeout-duration-secs", "5", "--request-timeout-secs", "7200",
          "--prometheus-host", host, "--prometheus-port", str(metrics_port),
          "--log-level", "warn"]


def launch(worker_urls: Sequence[str], *, timeout: float = 60.0
           ) -> tuple[subprocess.Popen, str]:
  """Start the router on 127.0.0.1 over `worker_urls` and return (process, URL) once every
  worker is registered and healthy; TimeoutError naming the router and the workers
  otherwise (the process is stopped)."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  log = tempfile.TemporaryFile("w+")
  line = command(worker_urls, port=port, metrics_port=_free_port())
  line = exiting_with_parent(line)
  # Its own session keeps it apart from the trainer's Ctrl-C: the trainer stops it cleanly.
  process = subprocess.Popen(line, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  deadline = time.monotonic() + timeout
  while True:
    if process.poll() is not None:
      log.seek(0)
      raise RuntimeError(f"sglang-router exited with code {process.returncode} before serving: "
                         f"{log.read()[-2000:]}")
    healthy = {w["url"] for w in workers(url) if w.get("is_healthy")} if _listening(port) \
        else set()
    if healthy >= {u.rstrip("/") for u in worker_urls}:
      return process, url
    if time.monotonic() > deadline:
      stop(process)
      raise TimeoutError(f"sglang-router at {url} did not list every worker as healthy within "
                         f"{timeout} s: healthy {sorted(healthy)}, asked for {list(worker_urls)}")
    time.sleep(0.2)


# Runs COMMAND so that it gets SIGTERM when the process that started it dies, also by SIGKILL
# (Linux's PR_SET_PDEATHSIG, 1, kept across exec): a killed trainer leaves no router behind.
# A small exec-ing launcher rather than a preexec_fn, which would fork a threaded process.
_EXIT_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                     "os.getppid() == int(sys.argv[1]) or sys.exit('parent gone'); "
                     "os.execv(sys.argv[2], sys.argv[2:])")


def exiting_with_parent(line: list[str]) -> list[str]:
  """`line` (an executable's path first) run so that it gets SIGTERM when this process dies
  (on Linux; elsewhere as it is). Start it from a thread that outlives it: the signal comes
  when the thread that started it ends."""
  if sys.platform != "linux":
    return line
  return [sys.executable, "-c", _EXIT_WITH_PARENT, str(os.getpid()), *line]


def _listening(port: int) -> bool:
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
      return True
  except OSError:
    return False


def workers(router_url: str) -> list[dict]:
  """The router's workers (GET /workers): url, is_healthy, load, ..."""
  try:
    with urllib.request.urlopen(router_url + "/workers", timeout=5) as reply:
      return json.load(reply)["workers"]
  except (urllib.error.URLError, OSError, ValueError, KeyError):
    return []


def add_worker(router_url: str, worker_url: str) -> None:
  """Register a new worker (POST /workers); the router health-checks it before routing to it."""
  request = urllib.request.Request(router_url + "/workers", method="POST",
                                   data=json.dumps({"url": worker_url}).encode(),
                                   headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=10) as reply:
    if reply.status not in (200, 202):
      raise RuntimeError(f"{router_url}/workers answered HTTP {reply.status} adding {worker_url}")


def stop(process: subprocess.Popen) -> None:
  """SIGTERM, then SIGKILL after 10 s, to the router's process group."""
  if process.poll() is None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait(timeout=10)
