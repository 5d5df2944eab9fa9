"""Math word problems from JSONL ({"problem", "answer"}, optional "solution") scored by the
math verifier (rl/verifiers/math.py).

Owns the prompt template and the task protocol around the verifier. A bundled sample
(rl/tasks/data/math_{train,test}.jsonl) serves tests and demos.
"""

import dataclasses
from typing import Any

from rl.tasks.jsonl import BUNDLED, Records, read_jsonl
from rl.verifiers import math as math_verifier

TEMPLATE = ("{problem}\nPlease reason step by step, and put your final answer within "
            "\\boxed{{}}.")


@dataclasses.dataclass
class MathTask:
  """`verifier`, when given, checks answers in its time-bounded worker pool; without one
  they are checked in-process (fine for trusted golds and short answers)."""

  train_path: str = str(BUNDLED / "math_train.jsonl")
  test_path: str = str(BUNDLED / "math_test.jsonl")
  template: str = TEMPLATE
  verifier: math_verifier.MathVerifier | None = None

  def __post_init__(self):
    self.train: Records = read_jsonl(self.train_path, ("problem", "answer"))
    self.test: Records = read_jsonl(self.test_path, ("problem", "answer"))

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
