"""JSONL-backed records: one JSON object per line, checked for the keys a task needs.

Owns reading and validating a task file and exposing it as a grain random-access source.
"""

import dataclasses
import json
import pathlib
from typing import Any, Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Records:
  """grain RandomAccessDataSource over a list of dict records."""
  records: tuple[dict[str, Any], ...]
  origin: str

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < len(self.records):
      raise IndexError(f"{self.origin}: index {index} out of range [0, {len(self.records)})")
    return self.records[index]


def read_jsonl(path: str | pathlib.Path, required: Sequence[str],
               convert: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
               ) -> Records:
  """Records of a JSONL file, each passed through `convert(record, "FILE:LINE")` when given;
  an unreadable line or a missing key raises ValueError naming the file, the line and what
  is missing."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"task file {path} does not exist")
  records = []
  with path.open() as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
      missing = [key for key in required if key not in record]
      if missing:
        raise ValueError(f"{path}:{number}: missing key(s) {missing}; a record needs "
                         f"{list(required)}")
      records.append(record if convert is None else convert(record, f"{path}:{number}"))
  if not records:
    raise ValueError(f"{path}: no records")
  return Records(tuple(records), str(path))


BUNDLED = pathlib.Path(__file__).with_name("data")
