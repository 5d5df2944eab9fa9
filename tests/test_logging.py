"""rl/loggers.py: TensorBoard event files and W&B offline runs hold metrics.jsonl's scalars,
read back with each package's own record formats (no network)."""

import glob
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from rl import eval as eval_lib
from rl import loggers, metrics, samples, trainer
from rl.config import RLConfig
from models import config
from rl.tasks.arithmetic import Arithmetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(data: bytes, start: int = 0):
  """TFRecord framing: u64 length, masked crc32c of it, the bytes, their masked crc32c."""
  crc = loggers._tensorboardx().record_writer.masked_crc32c
  pos = start
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == crc(header)
    payload = data[pos + 12:pos + 12 + length]
    assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == crc(payload)
    yield payload
    pos += 16 + length


def tensorboard_events(log_dir: str):
  """Every Event of the event files in `log_dir`, oldest file first, parsed with
  tensorboardX's protos (tensorboardX has no reader of its own)."""
  event_pb2 = loggers._tensorboardx().proto.event_pb2
  events = []
  for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
    events += [event_pb2.Event.FromString(r) for r in _records(open(path, "rb").read())]
  return events


def tensorboard_scalars(log_dir: str) -> dict[int, dict[str, float]]:
  steps: dict[int, dict[str, float]] = {}
  for event in tensorboard_events(log_dir):
    for value in event.summary.value:
      if value.WhichOneof("value") == "simple_value":
        steps.setdefault(event.step, {})[value.tag] = value.simple_value
  return steps


def wandb_history(run_dir: str) -> list[dict]:
  """The history rows of the offline W&B run under run_dir/wandb, from its .wandb file: a
  7-byte header, then LevelDB-log records (crc32 u32, length u16, type u8; 32 KiB blocks;
  type 1 = whole record, 2/3/4 = first/middle/last piece) of W&B's Record protos."""
  from wandb.proto import wandb_internal_pb2
  (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  rows, pos, pieces = [], 7, b""
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
      pos += 32768 - pos % 32768
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if pos + 7 + length > len(data):  # a record still being written
      break
    pieces += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record.FromString(pieces)
      pieces = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


def test_tensorboard_writes_names_as_they_are_and_marks_a_resume(tmp_path):
  log_dir = str(tmp_path)
  first = loggers.TensorBoard(log_dir)
  for step in range(4):
    first.log(step, {"reward": 0.25 * step, "eval_pass@8": 0.5},
              {"distribution/advantages": np.arange(step + 3.0)})
  first.close()
  resumed = loggers.TensorBoard(log_dir, resume_step=2)  # redoes step 3
  resumed.log(3, {"reward": 1.0}, {})
  resumed.close()
  events = tensorboard_events(log_dir)
  scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value
             if v.WhichOneof("value") == "simple_value"]
  assert scalars[:8] == [(s, tag, value) for s in range(4) for tag, value in
                         (("reward", 0.25 * s), ("eval_pass@8", 0.5))]
  assert scalars[8:] == [(3, "reward", 1.0)]
  histograms = [(e.step, v.histo) for e in events for v in e.summary.value
                if v.tag == "distribution/advantages"]
  assert [(s, h.num, h.min, h.max, h.sum) for s, h in histograms] == [
      (s, s + 3, 0.0, s + 2.0, sum(range(s + 3))) for s in range(4)]
  # TensorBoard purges the earlier files' points from a SessionLog START's step on.
  (start,) = [e for e in events if e.HasField("session_log")]
  assert start.step == 3 and start.session_log.status == start.session_log.START


def test_event_files_opened_within_one_second_sort_in_the_order_they_were_opened(
    tmp_path, monkeypatch):
  # TensorBoard reads a folder's event files in name order; tensorboardX names them by the
  # second. Eleven writers in one second (a resume in a warm process takes less) must sort as
  # opened, or a resumed run's SessionLog START would be read before the points it hides.
  monkeypatch.setattr(time, "time", lambda: 1796669153.25)
  for step in range(11):
    writer = loggers.TensorBoard(str(tmp_path))
    writer.log(step, {"reward": float(step)}, {})
    writer.close()
  assert len(glob.glob(str(tmp_path / "events.out.tfevents.1796669153.*"))) == 11
  assert [e.step for e in tensorboard_events(str(tmp_path)) if e.summary.value] == list(range(11))


def test_tensorboard_logging_does_not_import_torch(tmp_path):
  """tensorboardX's writer imports torch where it is installed (as in the test extra)."""
  code = ("import sys; from rl import loggers; w = loggers.TensorBoard(sys.argv[1]); "
          "w.log(1, {'a': 1.0}, {}); w.close(); import tensorboardX; "
          "assert 'torch' not in sys.modules; import torch")  # still importable after
  result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_a_run_logs_every_scalar_to_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
  for name in ("CONFIG", "CACHE", "DATA"):  # nothing outside tmp_path
    monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb_{name.lower()}"))
  monkeypatch.setenv("WANDB_MODE", "offline")
  run_dir = str(tmp_path / "run")
  trainer.train(run_dir, task=Arithmetic(digits=1, num_train=500, num_test=50),
                model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
                rl=RLConfig(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16,
                            seq_len=32, num_steps=2),
                start=trainer.WarmStart(steps=5, batch_size=16),
                hooks=trainer.Hooks(
                    evaluation=trainer.Evaluation(
                        records=8, every=2,
                        sampled=eval_lib.SampledEval(samples=2, ks=(1, 2), budgets=(16,))),
                    progress=False, wandb_project="longrl-test"))
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2]
  assert "eval_pass@2" in records[2]
  expected = {r["step"]: loggers.scalars(r) for r in records}

  logged = tensorboard_scalars(run_dir)
  assert logged.keys() == expected.keys()
  for step, values in expected.items():
    assert logged[step].keys() == values.keys(), step
    np.testing.assert_allclose([logged[step][k] for k in values], list(values.values()),
                               rtol=1e-6, err_msg=str(step))  # float32 in the event file
  histograms = {(e.step, v.tag): v.histo for e in tensorboard_events(run_dir)
                for v in e.summary.value if v.WhichOneof("value") == "histo"}
  assert set(histograms) == {(s, f"distribution/{name}") for s in (1, 2)
                             for name in ("advantages", "completion_length")}
  assert all(h.num == 16 for h in histograms.values())  # 4 prompts x 4 samples

  assert os.path.exists(os.path.join(run_dir, "wandb", "run_id"))
  # W&B's writer is a service process of its own, which may still be flushing the run's file
  # when the run has returned (on a loaded machine it was, once): wait for it, up to 30 s.
  deadline = time.monotonic() + 30
  while len(history := wandb_history(run_dir)) < 3 and time.monotonic() < deadline:
    time.sleep(0.2)
  assert [row["_step"] for row in history] == [0, 1, 2]
  for row in history:
    values = expected[row["_step"]]
    np.testing.assert_allclose([row[k] for k in values], list(values.values()), rtol=1e-12)
  assert history[1]["distribution/advantages/_type"] == "histogram"
  # The evaluation's samples as a W&B Table, its rows samples.jsonl's.
  assert history[2]["samples/eval/_type"] == "table-file", sorted(history[2])
  (files,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "files"))
  saved = json.load(open(os.path.join(files, history[2]["samples/eval/path"])))
  rows = [r for r in metrics.read(os.path.join(run_dir, samples.FILE))
          if (r["step"], r["split"]) == (2, "eval")]
  assert len(rows) == 4  # Hooks.samples' default
  assert saved["columns"] == list(samples.COLUMNS) and saved["data"] == samples.cells(rows)
