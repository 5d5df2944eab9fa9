"""Tokenizers. `CharTokenizer` maps each character of a fixed alphabet to one id; it serves
the synthetic tasks, where a real vocabulary would only slow a tiny model down."""

import dataclasses
import string
from typing import Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + "+-*/=()<>.,;:#? "


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Ids 0, 1, 2 are <pad>, <bos>, <eos>; the alphabet follows in order."""

  alphabet: str = DEFAULT_ALPHABET

  def __post_init__(self):
    if len(set(self.alphabet)) != len(self.alphabet):
      raise ValueError(f"CharTokenizer alphabet has repeated characters: {self.alphabet!r}")

  @property
  def special_tokens(self) -> tuple[str, ...]:
    return (PAD, BOS, EOS)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def vocab_size(self) -> int:
    return len(self.special_tokens) + len(self.alphabet)

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    offset = len(self.special_tokens)
    index = {c: i + offset for i, c in enumerate(self.alphabet)}
    unknown = sorted(set(text) - index.keys())
    if unknown:
      raise ValueError(f"CharTokenizer cannot encode characters {unknown} in {text[:60]!r}; "
                       f"its alphabet is {self.alphabet!r}")
    ids = [index[c] for c in text]
    return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, stopping at the first <eos> and skipping other special tokens."""
    offset = len(self.special_tokens)
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i >= offset:
        out.append(self.alphabet[i - offset])
    return "".join(out)
