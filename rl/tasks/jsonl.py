"""Task records from a file: JSONL (one JSON object per line) or Parquet (one record per
row: the format the field's datasets are published in on the Hugging Face hub), checked for
the keys a task needs.

Owns reading and validating a task file and exposing it as a grain random-access source.
"""

import dataclasses
import json
import pathlib
from typing import Any, Callable, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Records:
  """grain RandomAccessDataSource over a list of dict records."""
  records: tuple[dict[str, Any], ...]
  origin: str

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
    if isinstance(index, slice):  # task.test[:200], as one would take a list's
      return list(self.records[index])
    if not 0 <= index < len(self.records):
      raise IndexError(f"{self.origin}: index {index} out of range [0, {len(self.records)})")
    return self.records[index]


def read_records(path: str | pathlib.Path, required: Sequence[str],
                 convert: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
                 ) -> Records:
  """Records of a JSONL file or, for a name ending in .parquet, a Parquet file, each passed
  through `convert(record, where)` when given (`where`: "FILE:LINE" or "FILE:row N"); an
  unreadable line or a missing key raises ValueError naming the file, the line or row and
  what is missing."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"task file {path} does not exist")
  rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
  records = []
  for where, record in rows:
    if not isinstance(record, dict):
      raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [key for key in required if key not in record]
    if missing:
      raise ValueError(f"{where}: missing key(s) {missing}; a record needs {list(required)}")
    records.append(record if convert is None else convert(record, where))
  if not records:
    raise ValueError(f"{path}: no records")
  return Records(tuple(records), str(path))


def _jsonl_rows(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
  with path.open() as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield f"{path}:{number}", json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None


def _parquet_rows(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
  import pyarrow.parquet  # only for Parquet files
  number = 0
  for batch in pyarrow.parquet.ParquetFile(path).iter_batches():
    for row in batch.to_pylist():
      number += 1
      yield f"{path}:row {number}", row


BUNDLED = pathlib.Path(__file__).with_name("data")
