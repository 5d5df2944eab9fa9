"""Math word problems from JSONL or Parquet, scored by the math verifier
(rl/verifiers/math.py).

Owns the prompt template, reading the shapes the field publishes its math data in, and the
task protocol around the verifier. A record becomes {"problem", "answer", "solution"?}:
- MATH, DeepScaleR, AIME: `problem` and `answer`, or a `solution` whose last \\boxed{} is
  the answer;
- GSM8K: `question` and an `answer` that is the worked solution ending in "#### N" (the
  answer is N; the solution, for an SFT demonstration, is the reasoning without GSM8K's
  <<calculator>> annotations, then "The answer is \\boxed{N}.").
`fields` maps our names to the file's (GSM8K: {'problem': 'question'}). A bundled sample
(rl/tasks/data/math_{train,test}.jsonl) serves tests and demos.
"""

import dataclasses
import re
from typing import Any, Mapping, Optional

from rl.tasks.jsonl import BUNDLED, Records, read_records
from rl.verifiers import math as math_verifier

TEMPLATE = ("{problem}\nPlease reason step by step, and put your final answer within "
            "\\boxed{{}}.")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's annotations: 48/2=<<48/2=24>>24


def math_record(raw: dict[str, Any], fields: Mapping[str, str], where: str) -> dict[str, Any]:
  """`raw` (one line of a file) as {"problem", "answer", "solution"?}; ValueError naming
  `where` when it has no problem or no answer."""
  record = {ours: raw[theirs] for ours, theirs in fields.items() if theirs in raw}
  if not isinstance(record.get("problem"), str):
    raise ValueError(f"{where}: no problem text (field {fields['problem']!r})")
  answer, solution = record.get("answer"), record.get("solution")
  if isinstance(answer, str) and "####" in answer:  # GSM8K
    reasoning, _, final = answer.rpartition("####")
    answer = final.strip().replace(",", "")
    reasoning = _CALCULATOR.sub("", reasoning).strip()
    solution = solution or f"{reasoning}\nThe answer is \\boxed{{{answer}}}."
  elif answer is None and isinstance(solution, str):  # MATH: the solution's last \boxed{}
    answer = math_verifier.last_boxed(solution)
  if answer is None or str(answer).strip() == "":
    raise ValueError(f"{where}: no answer (field {fields['answer']!r}, or a "
                     f"{fields['solution']!r} with \\boxed{{}})")
  out = {**raw, "problem": record["problem"], "answer": str(answer).strip()}
  if solution is not None:
    out["solution"] = solution
  return out


@dataclasses.dataclass
class MathTask:
  """`fields` maps "problem", "answer" and "solution" to the file's field names (default:
  the same names; GSM8K: {'problem': 'question'}). `verifier`, when given, checks answers in
  its time-bounded worker pool; without one they are checked in-process (fine for trusted
  golds and short answers)."""

  train_path: str = str(BUNDLED / "math_train.jsonl")
  test_path: str = str(BUNDLED / "math_test.jsonl")
  template: str = TEMPLATE
  verifier: math_verifier.MathVerifier | None = None
  fields: Optional[Mapping[str, str]] = None

  def __post_init__(self):
    for name in ("train_path", "test_path"):
      if not getattr(self, name):
        raise ValueError(f"MathTask.{name} is not set: name a JSONL file of problems")
    fields = {"problem": "problem", "answer": "answer", "solution": "solution",
              **(self.fields or {})}
    unknown = sorted(set(fields) - {"problem", "answer", "solution"})
    if unknown:
      raise ValueError(f"MathTask.fields names {unknown}; it maps 'problem', 'answer' and "
                       "'solution' to the file's field names")
    self.train: Records = self._read(self.train_path, fields)
    self.test: Records = self._read(self.test_path, fields)

  @staticmethod
  def _read(path: str, fields: Mapping[str, str]) -> Records:
    return read_records(path, (fields["problem"],),
                      lambda record, where: math_record(record, fields, where))

  def prompt(self, record: dict[str, Any]) -> str:
    return self.template.format(problem=record["problem"])

  def solution(self, record: dict[str, Any]) -> str:
    return record.get("solution") or f"The answer is \\boxed{{{record['answer']}}}."

  def well_formed(self, completion: str) -> bool:
    return math_verifier.extract_answer(completion).answer is not None

  def answer(self, completion: str) -> str | None:
    """The extracted answer, normalized, as majority voting's key (equal strings vote
    together; equivalent spellings such as 0.5 and 1/2 do not)."""
    extracted = math_verifier.extract_answer(completion).answer
    return None if extracted is None else math_verifier.normalize(extracted)

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    if self.verifier is not None:
      return self.verifier.check(completion, record["answer"]).correct
    return math_verifier.verify(completion, record["answer"]).correct
