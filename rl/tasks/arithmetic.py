"""Synthetic multi-operand addition with a column-by-column chain of thought.

Owns problem generation, the reference solutions and the verifier. Difficulty is set by
`digits` (each operand has 1..digits digits) and `operands`. Reference solutions add the
columns from the least significant digit, carrying explicitly, then give the answer:

    47+85=   ->   7+5=12;4+8+1=13;#132

With `filler` > 0 each solution starts with 0..filler "hmm;" steps: length that a length
penalty can remove without touching correctness. (Leading rather than interleaved, so the
column steps stay contiguous and a small model learns them as fast as without filler.)

With `sloppy` > 0 the reference solutions are an imperfect demonstrator: with that
probability a solution whose last column carries drops the carry from its final answer
(`...;3+9+1=13;#32` for 47+85... written as `#32` instead of `#132`). The verifier still
checks the true sum, so SFT on these demonstrations learns the mistake and RL can unlearn it.
Records carry `final_carry` (1 when the last column carries): with `sloppy` > 0 those are the
hard prompts, a difficulty field for rl.sampling.field_difficulty.

With `direct` > 0 that share of the reference solutions is the bare final answer ("#132", no
column steps, no filler): a short mode that a small model gets right less often than the
column steps, so that tokens buy accuracy and a length budget has something to cut. Which
records answer directly is a pure function of (split, index), drawn apart from the problem
itself: the problems are those of `direct` = 0.

Train and test problems are disjoint: a problem belongs to the test split iff a stable hash
of its text falls in one bucket of ten.
"""

import dataclasses
import random
import re
import zlib
from typing import Any

_FILLER = "hmm;"
_TEST_BUCKET = 0
_ANSWER = re.compile(r"#(\d+)$")
_FORMAT = re.compile(r"(?:[\d+]+=\d+;|hmm;)*#\d+")


def _is_test(question: str) -> bool:
  return zlib.crc32(question.encode()) % 10 == _TEST_BUCKET


def _number(rng: random.Random, num_digits: int) -> int:
  return rng.randrange(10 ** (num_digits - 1) if num_digits > 1 else 0, 10 ** num_digits)


def column_solution(operands: list[int], *, drop_final_carry: bool = False) -> list[str]:
  """The chain-of-thought steps (without filler) and final answer for sum(operands);
  with `drop_final_carry` the answer leaves out the last column's carry."""
  width = max(len(str(x)) for x in operands)
  steps, carry = [], 0
  for col in range(width):
    digits = [str(x)[::-1][col] for x in operands if col < len(str(x))]
    terms = digits + ([str(carry)] if carry else [])
    total = sum(int(t) for t in terms)
    steps.append("+".join(terms) + f"={total};")
    carry = total // 10
  answer = str(sum(operands))
  steps.append("#" + (answer[1:] if drop_final_carry and carry else answer))
  return steps


@dataclasses.dataclass(frozen=True)
class ArithmeticSource:
  """grain random-access source of addition problems; record i is a pure function of
  (seed, split, i)."""

  split: str
  num_records: int
  digits: int
  operands: int
  filler: int
  sloppy: float
  seed: int
  direct: float = 0.0

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < self.num_records:
      raise IndexError(f"ArithmeticSource({self.split}) index {index} out of range "
                       f"[0, {self.num_records})")
    rng = random.Random(f"{self.seed}/{self.split}/{index}")
    want_test = self.split == "test"
    while True:
      numbers = [_number(rng, rng.randint(1, self.digits)) for _ in range(self.operands)]
      question = "+".join(map(str, numbers))
      if _is_test(question) == want_test:
        break
    steps = column_solution(numbers, drop_final_carry=rng.random() < self.sloppy)
    steps = [_FILLER] * rng.randint(0, self.filler) + steps
    if self.direct and random.Random(f"direct/{self.split}/{index}").random() < self.direct:
      steps = steps[-1:]
    width = max(len(str(x)) for x in numbers)
    return {"question": question, "answer": str(sum(numbers)), "solution": "".join(steps),
            "digits": width, "final_carry": int(sum(numbers) >= 10 ** width)}


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """The arithmetic Task. `prompt` is "<question>=", the completion is the solution."""

  digits: int = 2
  operands: int = 2
  filler: int = 0
  sloppy: float = 0.0
  direct: float = 0.0
  num_train: int = 20_000
  num_test: int = 1_000
  seed: int = 0

  def __post_init__(self):
    if self.digits < 1 or self.operands < 2:
      raise ValueError(f"Arithmetic needs digits >= 1 and operands >= 2, got digits="
                       f"{self.digits}, operands={self.operands}")
    for name in ("sloppy", "direct"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"Arithmetic.{name} must be a probability, got {getattr(self, name)}")

  @property
  def train(self) -> ArithmeticSource:
    return ArithmeticSource("train", self.num_train, self.digits, self.operands, self.filler,
                            self.sloppy, self.seed, self.direct)

  @property
  def test(self) -> ArithmeticSource:
    return ArithmeticSource("test", self.num_test, self.digits, self.operands, self.filler,
                            self.sloppy, self.seed, self.direct)

  def prompt(self, record: dict[str, Any]) -> str:
    return record["question"] + "="

  def solution(self, record: dict[str, Any]) -> str:
    return record["solution"]

  def well_formed(self, completion: str) -> bool:
    """Column steps ("d+d(+c)=s;" or filler) followed by "#<digits>", nothing else."""
    return _FORMAT.fullmatch(completion.strip()) is not None

  def answer(self, completion: str) -> str | None:
    match = _ANSWER.search(completion.strip())
    return match.group(1) if match else None

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    """True iff the completion ends in "#<the right sum>" (a truncated one never does)."""
    match = _ANSWER.search(completion.strip())
    return match is not None and match.group(1) == record["answer"]
