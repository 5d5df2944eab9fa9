"""Several tasks as one, each record tagged with its task's name as its "domain".

Owns the interleaving and the dispatch: record i of a split is record i // n of task i % n (n
tasks, in the order given), plus "domain"; prompt, solution, verify, well_formed and answer
go to the record's own task. The domain is what on-policy distillation routes a record to its
teacher by (rl/distill.py), and `only(name)` is one domain's task alone (an expert's).
"""

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """grain random-access source interleaving the splits of several tasks."""
  sources: tuple[tuple[str, Any], ...]

  def __len__(self) -> int:
    return min(len(s) for _, s in self.sources) * len(self.sources)

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < len(self):
      raise IndexError(f"MixtureSource index {index} out of range [0, {len(self)})")
    inner, which = divmod(index, len(self.sources))
    name, source = self.sources[which]
    return {**source[inner], "domain": name}


@dataclasses.dataclass(frozen=True)
class Mixture:
  """`tasks` (domain name -> Task) as one task."""
  tasks: Mapping[str, Any]

  def __post_init__(self):
    if not self.tasks:
      raise ValueError("Mixture needs at least one task")

  @property
  def train(self) -> MixtureSource:
    return MixtureSource(tuple((n, t.train) for n, t in self.tasks.items()))

  @property
  def test(self) -> MixtureSource:
    return MixtureSource(tuple((n, t.test) for n, t in self.tasks.items()))

  def only(self, name: str) -> "Mixture":
    """One domain's task alone, its records still tagged with the domain."""
    if name not in self.tasks:
      raise ValueError(f"Mixture has no domain {name!r}; it has {sorted(self.tasks)}")
    return Mixture({name: self.tasks[name]})

  def _task(self, record: dict[str, Any]):
    return self.tasks[record["domain"]]

  def prompt(self, record: dict[str, Any]) -> str:
    return self._task(record).prompt(record)

  def solution(self, record: dict[str, Any]) -> str:
    return self._task(record).solution(record)

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self._task(record).verify(completion, record)

  def well_formed(self, completion: str) -> bool:
    return any(t.well_formed(completion) for t in self.tasks.values())

  def answer(self, completion: str) -> str | None:
    return next((a for t in self.tasks.values() if (a := t.answer(completion)) is not None),
                None)
