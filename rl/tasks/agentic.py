"""Agentic arithmetic: sums of numbers too long for a tiny model to add in its head, with a
calculator it can call. Copying the problem into a `calc` call and the calculator's result into
the answer is the winning policy:

    123456+654321=  ->  <calc>123456+654321</calc><result>777777</result>#777777

(prompt, the policy's call, the environment's observation, the policy's answer). The problems,
splits and verifier are those of the wrapped `Arithmetic` task (its digits and operands set the
difficulty); the verifier checks the final "#<sum>" of the whole episode.

The SFT warm start shows the call format on a fraction of the demonstrations: on
`call_fraction` of the problems whose widest operand has at least `call_min_digits` digits
(a stable hash of the question picks them); every other demonstration answers directly
("#777777"), which a small model gets wrong on long numbers, so RL has something to learn.
Demonstrations are given as segments (`solution_segments`): the observation's tokens are in
the sequence but out of the SFT loss, as they are out of the RL loss.
"""

import dataclasses
import zlib
from typing import Any

from rl.envs.tool_env import ToolEnvironment
from rl.tasks.arithmetic import Arithmetic


@dataclasses.dataclass(frozen=True)
class ToolArithmetic:
  """Arithmetic with a calculator. `environment` must be a ToolEnvironment with the `calc`
  tool (its call format shapes the demonstrations)."""

  arithmetic: Arithmetic = Arithmetic(digits=8, operands=2)
  environment: ToolEnvironment = dataclasses.field(
      default_factory=lambda: ToolEnvironment(("calc",)))
  call_fraction: float = 0.5
  call_min_digits: int = 4

  def __post_init__(self):
    if not isinstance(self.environment, ToolEnvironment) or \
        "calc" not in self.environment.tool_names:
      raise ValueError("ToolArithmetic.environment must be a ToolEnvironment with the 'calc' "
                       f"tool, got {self.environment!r}")
    if not 0.0 <= self.call_fraction <= 1.0:
      raise ValueError(f"ToolArithmetic.call_fraction must be a probability, got "
                       f"{self.call_fraction}")

  @property
  def train(self):
    return self.arithmetic.train

  @property
  def test(self):
    return self.arithmetic.test

  def prompt(self, record: dict[str, Any]) -> str:
    return self.arithmetic.prompt(record)

  def calls(self, record: dict[str, Any]) -> bool:
    """Whether the demonstration for `record` calls the calculator."""
    if record["digits"] < self.call_min_digits:
      return False
    return zlib.crc32(record["question"].encode()) % 1000 < 1000 * self.call_fraction

  def solution_segments(self, record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The demonstration as (text, policy's) spans: False on observation text."""
    answer = "#" + record["answer"]
    if not self.calls(record):
      return [(answer, True)]
    fmt = self.environment.format
    return [(fmt.call_text("calc", record["question"], "expression"), True),
            (fmt.observation_text([record["answer"]]), False), (answer, True)]

  def solution(self, record: dict[str, Any]) -> str:
    return "".join(text for text, _ in self.solution_segments(record))

  def well_formed(self, completion: str) -> bool:
    return self.arithmetic.answer(completion) is not None

  def answer(self, completion: str) -> str | None:
    return self.arithmetic.answer(completion)

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self.arithmetic.verify(completion, record)
