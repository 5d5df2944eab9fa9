"""Tools the policy can call, registered by name: `calc` (exact arithmetic) and `python` (the
model's code in the bubblewrap sandbox of rl/verifiers/code.py).

A tool is a function of its arguments (a tagged block's text as one argument, or a JSON call's
arguments as keywords) that returns the text fed back to the model. A tool that fails raises
ToolError (its message becomes the observation), ToolTimeout when it ran out of time; any
other exception is reported the same way, so a broken tool never ends a run. Adding a tool is
one function and one registration:

    @register_tool("lookup")
    def lookup(key: str) -> str:
      return CAPITALS.get(key.strip().lower(), "unknown")

A tool that holds resources (a pool of sandboxes) registers a factory instead
(`register_tool_factory`): each environment calls it once with its options for that tool, and
closes what it returns (a callable with a `close()`) when the environment closes.

Owns the registry and the two built-in tools; it does not own call syntax (formats.py) or the
per-call wall clock, output budget and counting (tool_env.py).
"""

import ast
import concurrent.futures
import operator
import queue
import weakref
from typing import Any, Callable, Mapping, Sequence

from rl import ConfigError
from rl.verifiers import code as code_lib


class ToolError(Exception):
  """The call failed; the message says why and is what the model reads."""


class ToolTimeout(ToolError):
  """The call ran out of time (counted apart from other failures)."""


TOOLS: dict[str, Callable[..., Callable[..., str]]] = {}  # name -> factory(**options) -> tool


def register_tool(name: str):
  """Decorator: register a function `(arguments) -> str` as tool `name`."""

  def add(fn):
    register_tool_factory(name)(lambda: fn)
    return fn
  return add


def register_tool_factory(name: str):
  """Decorator: register `factory(**options) -> tool` (a callable; a `close()` on it is
  called when its environment closes) as tool `name`."""

  def add(factory):
    if name in TOOLS:
      raise ValueError(f"tool {name!r} is registered twice")
    TOOLS[name] = factory
    return factory
  return add


def open_tools(names: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None
               ) -> dict[str, Callable[..., str]]:
  """{name: tool} for `names`, each made by its factory with options[name]."""
  options = dict(options or {})
  unknown = sorted(set(names) - TOOLS.keys()) + sorted(set(options) - set(names))
  if unknown:
    raise ConfigError(f"unknown tool(s) {unknown} (options are only for the tools asked "
                      f"for); registered tools: {', '.join(sorted(TOOLS))}")
  return {name: TOOLS[name](**options.get(name, {})) for name in names}


# ----------------------------------------------------------------------------- calc

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_BITS = 3400  # about 1000 decimal digits


def _evaluate(node):
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    if isinstance(node.value, int) and node.value.bit_length() > _MAX_BITS:
      raise ToolError("a number is too large")
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and (
        not isinstance(right, int) or abs(right) > 1000 or
        isinstance(left, int) and left.bit_length() * abs(right) > _MAX_BITS):
      raise ToolError("the power is too large")
    try:
      value = _BINARY[type(node.op)](left, right)
    except ZeroDivisionError:
      raise ToolError("division by zero") from None
    except OverflowError:
      raise ToolError("the result is too large") from None
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
      raise ToolError("the result is too large")
    return value
  raise ToolError("only numbers, + - * / // % ** and parentheses are allowed")


@register_tool("calc")
def calc(expression: str) -> str:
  """Exact arithmetic: integers of any length (up to ~1000 digits) and decimals, with
  + - * / // % ** and parentheses. An integral result prints as an integer (6/3 -> 2)."""
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError:
    raise ToolError(f"cannot parse {expression.strip()[:40]!r}") from None
  value = _evaluate(tree)
  if isinstance(value, float):
    if value != value or value in (float("inf"), float("-inf")):
      raise ToolError("the result is not a finite number")
    if value.is_integer() and abs(value) < 1e15:
      return str(int(value))
    return f"{value:.12g}"
  return str(value)


# ----------------------------------------------------------------------------- python

@register_tool_factory("python")
class PythonTool:
  """Runs the model's code as a script in the sandbox of rl/verifiers/code.py (bubblewrap:
  no network, read-only system files, a private /tmp, memory, process and CPU limits, a wall
  clock) and returns what it printed, stderr after stdout. A pool of `workers` sandboxes is
  shared by every episode of the environment: each starts on its first call (about a second)
  and serves later calls without a restart. A program that passes the wall clock is killed
  (ToolTimeout); one that crashes, runs out of memory or prints past the output cap is a
  ToolError with the tail of its stderr. Each call is a fresh program: no state carries over
  between calls."""

  def __init__(self, *, workers: int = 2,
               limits: code_lib.Limits = code_lib.Limits(wall_seconds=5.0,
                                                         output_bytes=1 << 14),
               isolation: str = "auto"):
    self.limits = limits
    sandboxes = [code_lib.Sandbox(limits, isolation=isolation) for _ in range(workers)]
    self._idle: queue.Queue = queue.Queue()
    for sandbox in sandboxes:
      self._idle.put(sandbox)
    # The sandboxes run (and so are started) on threads that live as long as the tool:
    # bubblewrap's --die-with-parent kills a sandbox when the *thread* that started it ends.
    self._threads = concurrent.futures.ThreadPoolExecutor(workers,
                                                          thread_name_prefix="python-tool")
    # Closed with the environment, or at the latest when this tool is collected or the
    # interpreter exits (the sandboxes are processes).
    self._finalizer = weakref.finalize(self, _close_all, sandboxes, self._threads)

  def __call__(self, code: str) -> str:
    outcome = self._threads.submit(self._run, code).result()
    status, stdout, stderr = outcome["status"], outcome["stdout"], outcome["stderr"]
    if status == "ok":
      return stdout + stderr
    if status == "timeout":
      raise ToolTimeout(f"the program ran past its {self.limits.wall_seconds:g} s limit and "
                        f"was killed")
    detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    raise ToolError(f"{status}" + (f": {detail}" if detail else ""))

  def _run(self, code: str) -> dict:
    sandbox = self._idle.get()
    try:
      return sandbox.run(code)
    finally:
      self._idle.put(sandbox)

  def close(self) -> None:
    self._finalizer()


def _close_all(sandboxes, threads):
  threads.shutdown(wait=True)
  for sandbox in sandboxes:
    sandbox.close()
