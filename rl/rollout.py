"""The rollout path: task records in, verified trajectories out (training and evaluation alike).

Owns a prompt's tokens (`prompt_ids`), verification (`verify`: a trajectory's text, verdict and
format check) and `run` / `generate`: trajectories advanced by the driver (rl/envs/driver.py)
in the task's environment (OneTurn for a single-turn task), each verified as soon as it is
over, on a thread of its own (so in the task's worker pool: MathVerifier, CodeSandbox, Judge),
while the others are still generated. On servers, where completions arrive one by one,
verification runs concurrently with generation; the embedded engine hands over all of them at
once, and they are verified as one batch.

A trajectory counts as correct only if it finished on a stop token and the task's verifier
accepts its whole text (an episode's observations included): a truncated answer never scores.
It does not own which prompts are drawn or when rollouts pause (rl/sources.py).
"""

import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from models import vision
from rl.envs import driver
from rl.envs.base import environment_of
from rl.trajectory import Trajectory
from rollouts.engine import RolloutEngine, SamplingParams


def prompt_ids(task, tokenizer, record: dict[str, Any]) -> list[int]:
  """The tokens of `record`'s prompt. A record with `images` (its prompt marks each one's
  place with models.vision.IMAGE_MARKER) needs a vision-language model's tokenizer
  (models.tokenizer.WithImages): each marker becomes the model's image placeholder, one
  image token per token of the image's grid."""
  text, images = task.prompt(record), record.get("images") or []
  if not images:
    return tokenizer.encode(text, add_bos=True)
  v = getattr(tokenizer, "vision", None)
  if v is None:
    raise ValueError(f"a record with {len(images)} images, and the model takes no images: "
                     "train a vision-language model (its tokenizer is models.tokenizer."
                     "WithImages)")
  if text.count(vision.IMAGE_MARKER) != len(images):
    raise ValueError(f"a prompt with {text.count(vision.IMAGE_MARKER)} "
                     f"{vision.IMAGE_MARKER} markers for its {len(images)} images: "
                     f"{text[:80]!r}")
  ids = tokenizer.encode(text.replace(vision.IMAGE_MARKER, vision.PLACEHOLDER), add_bos=True)
  return vision.expand_image_tokens(ids, [vision.image_grid(im, v) for im in images], v)


def verify(task, tokenizer, trajectories: Sequence[Trajectory]) -> None:
  """Fill each trajectory's text, verdict and format check (in place). A task with a
  `verify_batch` verifies all of them in one call."""
  texts = [tokenizer.decode(t.token_ids) for t in trajectories]
  finished = [i for i, t in enumerate(trajectories) if not t.truncated]
  correct = np.zeros(len(trajectories), bool)
  verify_batch = getattr(task, "verify_batch", None)  # a task that verifies in one batch
  records = [trajectories[i].record for i in finished]
  if verify_batch is not None and finished:
    correct[finished] = verify_batch([texts[i] for i in finished], records)
  else:
    correct[finished] = [task.verify(texts[i], r) for i, r in zip(finished, records)]
  for t, text, right in zip(trajectories, texts, correct):
    t.text, t.correct = text, bool(right)
    t.well_formed = (not t.truncated) and bool(task.well_formed(text))


class _Verifying:
  """Verifies trajectories as they are handed over (lists of them), on a thread of its own:
  whatever has arrived since its last check is verified together (one verify_batch), so a
  batched verifier still sees batches."""

  def __init__(self, task, tokenizer):
    self._task, self._tokenizer = task, tokenizer
    self._arrived: queue.SimpleQueue = queue.SimpleQueue()
    self._error: BaseException | None = None
    self.busy_s = 0.0
    self._thread = threading.Thread(target=self._run, daemon=True, name="verifier")
    self._thread.start()

  def put(self, trajectories: list[Trajectory]) -> None:
    self._arrived.put(trajectories)

  def _run(self) -> None:
    ended = False
    while not ended:
      arrived = [self._arrived.get()]
      while not self._arrived.empty():
        arrived.append(self._arrived.get())
      ended = arrived[-1] is None  # put last, after every trajectory
      ready = [t for a in arrived if a is not None for t in a]
      if not ready or self._error is not None:
        continue
      started = time.perf_counter()
      try:
        verify(self._task, self._tokenizer, ready)
      except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by wait()
        self._error = e
      self.busy_s += time.perf_counter() - started

  def close(self) -> None:
    """Returns once everything handed over is verified and the thread has ended."""
    self._arrived.put(None)
    self._thread.join()

  def wait(self) -> None:
    """`close`, then raise what verifying raised."""
    self.close()
    if self._error is not None:
      raise self._error


def run(engine: RolloutEngine, task, tokenizer, trajectories: Sequence[Trajectory],
        sampling: SamplingParams, *, seed: int, max_sequence_tokens: int | None = None,
        pause: driver.Pause | None = None, timings: dict[str, float] | None = None
        ) -> dict[str, Any]:
  """Advance `trajectories` (in place) in the task's environment until they are over or
  `pause` says to pause (rl.envs.driver.advance, whose statistics it returns), verifying each
  one as it ends. sampling.max_new_tokens is a trajectory's budget of policy tokens and
  `max_sequence_tokens` the most tokens its prompt and continuation may hold (a packed row's
  room). `timings`, when given, gets added to its "generate_s" (an episode's tool calls count
  as generation), "verify_s" (the wait for verification after generation ended: its share of
  the critical path) and "verify_busy_s" (the verifying thread's whole time)."""
  started = time.perf_counter()
  verifying = _Verifying(task, tokenizer)
  try:
    stats = driver.advance(engine, environment_of(task), tokenizer, trajectories, sampling,
                           seed=seed, max_sequence_tokens=max_sequence_tokens, pause=pause,
                           on_over=verifying.put)
  except BaseException:
    verifying.close()  # generation's error is the one to raise
    raise
  generated = time.perf_counter()
  verifying.wait()
  if timings is not None:
    timings["generate_s"] = timings.get("generate_s", 0.0) + generated - started
    timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - generated
    timings["verify_busy_s"] = timings.get("verify_busy_s", 0.0) + verifying.busy_s
  return stats


def generate(engine: RolloutEngine, task, tokenizer, records: Sequence[dict],
             sampling: SamplingParams, *, samples: int = 1, seed: int = 0,
             max_sequence_tokens: int | None = None, record_indices: Sequence[int] | None = None,
             timings: dict[str, float] | None = None) -> list[Trajectory]:
  """`samples` verified trajectories per record, record-major: the samples of records[i] are
  group i (record_index: `record_indices[i]` when given). See `run`."""
  prompts = [prompt_ids(task, tokenizer, r) for r in records]
  indices = record_indices if record_indices is not None else [-1] * len(records)
  n = len(records) * samples
  trajectories = driver.start(
      environment_of(task), [r for r in records for _ in range(samples)],
      [p for p in prompts for _ in range(samples)],
      record_index=[i for i in indices for _ in range(samples)],
      group=np.repeat(np.arange(len(records)), samples), sample=np.arange(n) % samples)
  run(engine, task, tokenizer, trajectories, sampling, seed=seed,
      max_sequence_tokens=max_sequence_tokens, timings=timings)
  return trajectories
