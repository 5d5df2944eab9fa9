"""Key-value retrieval from a long context: the needle-in-a-haystack task of long-context RL.

Owns the haystacks, the question and the verifier. A prompt is `context` characters of
"key:value;" pairs (keys four lowercase letters, values four digits, every key once) and a
question naming one of the keys; the answer is its value:

    qhza:0412;mbte:9930;...;wkcn:5118;?mbte=   ->   #9930

(RULER's multi-key needle, Hsieh et al. 2024, arXiv:2404.06654.) The needle's place in the
haystack is uniform, so a policy must attend over the whole prompt. Its alphabet is the
CharTokenizer's, one token a character, so `context` is the prompt's length in tokens; it
sizes RL rows at 32k to 128k tokens (experiments/configs/long_context.gin,
bench/long_context.py). Record i is a pure function of (seed, split, i); train and test draw
from different streams.
"""

import dataclasses
import random
import re
import string
from typing import Any

_ENTRY = 10  # "abcd:1234;"
_ANSWER = re.compile(r"#(\d{4})$")


def _key(n: int) -> str:
  letters = []
  for _ in range(4):
    n, i = divmod(n, 26)
    letters.append(string.ascii_lowercase[i])
  return "".join(letters)


@dataclasses.dataclass(frozen=True)
class NeedleSource:
  """grain random-access source of haystacks; record i is a pure function of (seed, split,
  i)."""

  split: str
  num_records: int
  context: int
  seed: int

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < self.num_records:
      raise IndexError(f"NeedleSource({self.split}) index {index} out of range "
                       f"[0, {self.num_records})")
    rng = random.Random(f"needle/{self.seed}/{self.split}/{index}")
    entries = max(1, (self.context - len("?abcd=")) // _ENTRY)
    keys = [_key(n) for n in rng.sample(range(26 ** 4), entries)]
    values = [f"{rng.randrange(10_000):04d}" for _ in keys]
    needle = rng.randrange(entries)
    haystack = "".join(f"{k}:{v};" for k, v in zip(keys, values))
    return {"question": f"{haystack}?{keys[needle]}=", "answer": values[needle],
            "depth": needle / entries}


@dataclasses.dataclass(frozen=True)
class Needle:
  """The needle Task. `prompt` is the haystack and "?<key>=", the completion "#<value>".
  Records carry `depth` (where the needle sits, 0 = first), a field for
  rl.sampling.field_difficulty or for reading accuracy by depth."""

  context: int = 4096
  num_train: int = 10_000
  num_test: int = 200
  seed: int = 0

  def __post_init__(self):
    if self.context < 2 * _ENTRY:
      raise ValueError(f"Needle.context must be at least {2 * _ENTRY} characters, got "
                       f"{self.context}")

  @property
  def train(self) -> NeedleSource:
    return NeedleSource("train", self.num_train, self.context, self.seed)

  @property
  def test(self) -> NeedleSource:
    return NeedleSource("test", self.num_test, self.context, self.seed)

  def prompt(self, record: dict[str, Any]) -> str:
    return record["question"]

  def solution(self, record: dict[str, Any]) -> str:
    return "#" + record["answer"]

  def well_formed(self, completion: str) -> bool:
    return _ANSWER.fullmatch(completion.strip()) is not None

  def answer(self, completion: str) -> str | None:
    match = _ANSWER.search(completion.strip())
    return match.group(1) if match else None

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self.answer(completion) == record["answer"]
