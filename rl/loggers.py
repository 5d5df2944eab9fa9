"""Experiment loggers beside metrics.jsonl: TensorBoard event files and Weights & Biases.

Owns the writers. `rl.trainer.train` decides what goes in: every numeric field of each
metrics.jsonl record as a scalar at its step (same names), and histograms of per-completion
arrays the step has at hand (under `distribution/`), and tables of sample generations
(rl/samples.py: TensorBoard text as a Markdown table, a W&B Table). metrics.jsonl and
samples.jsonl stay the records a resumed run and the analyses read; these are for watching
runs and comparing them.

TensorBoard files are written with tensorboardX (a 90 KB pure-Python wheel over protobuf;
tensorboard's own writer comes with the TensorBoard server: 5.5 MB tensorboard,
6.6 MB tensorboard-data-server and 7.1 MB grpcio wheels, 55 MB installed with absl-py,
markdown and werkzeug). W&B is an optional extra (`pip install 'longrl[wandb]'`); with
WANDB_MODE=offline it needs no network or account and writes its run under
RUN_DIR/wandb (`wandb sync` uploads it later).
"""

import os
import secrets
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
  """The numeric fields of a metrics record, but its step."""
  return {key: float(value) for key, value in record.items()
          if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _tensorboardx():
  """tensorboardX, imported with torch hidden: its writer module imports torch, where it is
  installed, only to accept torch tensors (here ~1 s and ~200 MiB, and torch's own CUDA
  libraries in a JAX process); `import torch` failing is the case it handles."""
  if "torch" in sys.modules:
    import tensorboardX
    return tensorboardX
  sys.modules["torch"] = None  # makes `import torch` raise ImportError
  try:
    import tensorboardX
  finally:
    del sys.modules["torch"]
  return tensorboardX


def markdown_table(columns: Sequence[str], cells: Sequence[Sequence[Any]]) -> str:
  """A Markdown table of `cells` (one list per row), as TensorBoard's text plugin renders it:
  a cell's `|` is escaped and its line breaks become <br>, so that one row stays one line;
  None is an empty cell, a float has 4 significant digits."""
  def cell(value) -> str:
    text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")

  lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
  return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in cells])


# tensorboardX names an event file by the second it opened it and overwrites a file of the
# same name; TensorBoard reads a folder's files in name order, so a resumed run's SessionLog
# START must sort after the files it hides. The nanosecond of opening (19 digits until 2286)
# orders writers opened within one second, in one process or several; the pid keeps apart two
# processes opening in one nanosecond.
def _file_suffix() -> str:
  return f".{time.time_ns()}.{os.getpid()}"


class TensorBoard:
  """Event files in `log_dir` (`tensorboard --logdir` on it or on a folder of runs)."""

  def __init__(self, log_dir: str, *, resume_step: Optional[int] = None):
    tbx = _tensorboardx()
    self._event, self._summary = tbx.proto.event_pb2, tbx.proto.summary_pb2
    self._histogram, self._text = tbx.summary.histogram, tbx.summary.text
    self._writer = tbx.FileWriter(log_dir, flush_secs=30,
                                  filename_suffix=_file_suffix())
    if resume_step is not None:
      # TensorBoard drops the points from this step on that earlier files hold: those an
      # interrupted run logged after its last checkpoint, which this run redoes (as
      # metrics.truncate moves them out of metrics.jsonl).
      start = self._event.SessionLog(status=self._event.SessionLog.START)
      self._writer.add_event(self._event.Event(session_log=start), step=resume_step + 1)

  def log(self, step: int, values: Mapping[str, float],
          histograms: Mapping[str, np.ndarray]) -> None:
    # Summary values built here keep metrics.jsonl's names: tensorboardX's add_scalar would
    # rewrite "eval_pass@8" as "eval_pass_8".
    self._writer.add_summary(self._summary.Summary(value=[
        self._summary.Summary.Value(tag=tag, simple_value=value)
        for tag, value in values.items()]), step)
    for tag, array in histograms.items():
      self._writer.add_summary(
          self._histogram(tag, np.asarray(array, np.float64), bins="auto"), step)

  def table(self, step: int, tag: str, columns: Sequence[str],
            cells: Sequence[Sequence[Any]]) -> None:
    # As SummaryWriter.add_text writes it: TensorBoard shows it as `tag/text_summary`.
    self._writer.add_summary(self._text(tag, markdown_table(columns, cells)), step)

  def close(self) -> None:
    self._writer.close()


class WandB:
  """A W&B run in `project` with its files under `run_dir/wandb`; a resumed run continues the
  same W&B run (its id is kept in `run_dir/wandb/run_id`)."""

  def __init__(self, run_dir: str, *, project: str, config: Mapping[str, Any]):
    import wandb
    self._wandb = wandb
    id_path = os.path.join(run_dir, "wandb", "run_id")
    if os.path.exists(id_path):
      run_id = open(id_path).read().strip()
    else:
      run_id = secrets.token_hex(4)
      os.makedirs(os.path.dirname(id_path), exist_ok=True)
      with open(id_path, "w") as f:
        f.write(run_id)
    self._run = wandb.init(project=project, dir=run_dir, id=run_id, resume="allow",
                           name=os.path.basename(os.path.abspath(run_dir)), config=dict(config))

  def log(self, step: int, values: Mapping[str, float],
          histograms: Mapping[str, np.ndarray]) -> None:
    self._run.log({**values, **{tag: self._wandb.Histogram(np.asarray(array))
                                for tag, array in histograms.items()}}, step=step)

  def table(self, step: int, tag: str, columns: Sequence[str],
            cells: Sequence[Sequence[Any]]) -> None:
    table = self._wandb.Table(columns=list(columns), data=[list(row) for row in cells])
    self._run.log({tag: table}, step=step)

  def close(self) -> None:
    self._run.finish()


class Loggers:
  """The run's loggers as one: `log(record, histograms)` at the record's step, `table(step,
  tag, columns, cells)`."""

  def __init__(self, run_dir: str, *, tensorboard: bool, wandb_project: Optional[str],
               resume_step: Optional[int], config: Mapping[str, Any]):
    self._writers = []
    if tensorboard:
      self._writers.append(TensorBoard(run_dir, resume_step=resume_step))
    if wandb_project:
      self._writers.append(WandB(run_dir, project=wandb_project, config=config))

  def log(self, record: Mapping[str, Any],
          histograms: Optional[Mapping[str, np.ndarray]] = None) -> None:
    values = scalars(record)
    for writer in self._writers:
      writer.log(int(record["step"]), values, histograms or {})

  def table(self, step: int, tag: str, columns: Sequence[str],
            cells: Sequence[Sequence[Any]]) -> None:
    for writer in self._writers:
      writer.table(step, tag, columns, cells)

  def close(self) -> None:
    for writer in self._writers:
      writer.close()
