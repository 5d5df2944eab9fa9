"""Tasks: prompts behind a grain random-access data source, plus a verifier.

A Task has `train` and `test` sources (each `__len__` and `__getitem__` returning a dict
record, which is grain's RandomAccessDataSource protocol), `prompt(record) -> str`,
`verify(completion_text, record) -> bool`, `well_formed(completion_text) -> bool` (the
format check of format rewards), `answer(completion_text) -> str | None` (the final answer
majority voting compares, None when there is none), and `solution(record) -> str`, the
reference completion used for the SFT warm start. A task may also have
`verify_batch(completions, records) -> list[bool]`, which the loop then calls once per step
instead of `verify` per completion (a model-scored verifier batches its judge's calls:
rl/verifiers/judge.py). An agentic task has an `environment` (rl.envs.Environment): the loop
and the evaluation then run multi-turn episodes, `verify` sees an episode's whole text, and
`solution_segments(record) -> [(text, policy's)]` gives the SFT demonstrations with their
observation spans marked (rl/tasks/agentic.py).
"""

from typing import Any, Protocol

import grain


class Task(Protocol):
  train: grain.sources.RandomAccessDataSource
  test: grain.sources.RandomAccessDataSource

  def prompt(self, record: dict[str, Any]) -> str: ...

  def solution(self, record: dict[str, Any]) -> str: ...

  def verify(self, completion: str, record: dict[str, Any]) -> bool: ...

  def well_formed(self, completion: str) -> bool: ...

  def answer(self, completion: str) -> str | None: ...


def share_slice(count: int) -> slice:
  """This JAX process's contiguous part of `count` items, split with grain's ShardByJaxProcess
  options (one part per process, the first ones one longer when the count does not divide),
  so that the parts gathered in process order are the items in order. One process: all."""
  shard = grain.sharding.ShardByJaxProcess()
  base, extra = divmod(count, shard.shard_count)
  start = shard.shard_index * base + min(shard.shard_index, extra)
  return slice(start, start + base + (shard.shard_index < extra))


def process_share(source: grain.sources.RandomAccessDataSource, indices) -> list[dict[str, Any]]:
  """The records `indices` of `source` that this JAX process works on (its `share_slice`),
  read through a grain MapDataset."""
  mine = grain.MapDataset.source([int(i) for i in indices]).slice(share_slice(len(indices)))
  records = mine.map(lambda i: source[i])
  return [records[i] for i in range(len(records))]
