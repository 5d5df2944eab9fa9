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
