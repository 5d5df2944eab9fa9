"""Verified checkpoints (rl/checkpoint.py): each save writes checksums of its files; a restore
checks them, names a corrupt step in one line and falls back to the newest step that
restores, moving the bad one aside; with none, a clear error."""

import dataclasses
import json
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from models import config
from rl import checkpoint, trainer
from rl.checkpoint import CHECKSUMS, Checkpointer, CheckpointCorrupt
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic


def _state(step: int):
  """A loop-like state: params, AdamW's state, the step; values that differ by step."""
  rng = np.random.default_rng(step)
  params = {"w": rng.standard_normal((128, 128)).astype(np.float32),
            "b": rng.standard_normal(128).astype(np.float32)}
  return {"train": {"params": params, "opt_state": optax.adamw(1e-3).init(params)},
          "step": np.int32(step)}


def _like():
  return jax.tree.map(np.zeros_like, _state(0))


def _saved(tmp_path, steps=(1, 2)):
  """checkpoints/ under tmp_path with the states of `steps`; its path."""
  directory = str(tmp_path / "checkpoints")
  saver = Checkpointer(directory)
  for step in steps:
    saver.save(step, _state(step))
  saver.close()
  return directory


def _saved_before_checksums(tmp_path, steps=(1, 2)):
  """The same, as Checkpointer saved them before checksums (orbax alone)."""
  directory = str(tmp_path / "checkpoints")
  saver = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=2, create=True), item_handlers=ocp.StandardCheckpointHandler())
  for step in steps:
    saver.save(step, args=ocp.args.StandardSave(_state(step)))
  saver.close()
  assert not os.path.exists(os.path.join(directory, "2", "default", CHECKSUMS))
  return directory


def _files(step_dir: str) -> list[str]:
  """The files of a step's item directory, relative to it, but for the checksums and orbax's
  commit marker (written once the checksums are)."""
  item = os.path.join(step_dir, "default")
  return sorted(os.path.relpath(os.path.join(root, name), item)
                for root, _, names in os.walk(item) for name in names
                if name not in (CHECKSUMS, "commit_success.txt"))


def _largest(step_dir: str) -> str:
  item = os.path.join(step_dir, "default")
  return max(_files(step_dir), key=lambda name: os.path.getsize(os.path.join(item, name)))


def _flip(path: str) -> str:
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))
  return "sha256 differs"


def _truncate(path: str) -> str:
  size = os.path.getsize(path)
  os.truncate(path, size // 2)
  return f"{size // 2} bytes, expected {size}"


def _remove(path: str) -> str:
  os.remove(path)
  return "missing"


def _assert_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_a_save_writes_checksums_of_every_file(tmp_path):
  directory = _saved(tmp_path)
  for step in (1, 2):
    item = os.path.join(directory, str(step), "default")
    manifest = json.load(open(os.path.join(item, CHECKSUMS)))
    assert manifest["hash"] == "sha256"
    assert sorted(manifest["files"]) == _files(os.path.join(directory, str(step)))
    for name, (size, digest) in manifest["files"].items():
      assert size == os.path.getsize(os.path.join(item, name)) and len(digest) == 64
    assert checkpoint.verify_checksums(item) is None


@pytest.mark.parametrize("damage", [_flip, _truncate, _remove])
def test_a_corrupt_checkpoint_is_named_and_the_step_before_restores(tmp_path, capsys, damage):
  directory = _saved(tmp_path)
  name = _largest(os.path.join(directory, "2"))
  what = damage(os.path.join(directory, "2", "default", name))

  restorer = Checkpointer(directory)
  restored = restorer.restore(_like())
  _assert_equal(restored, _state(1))
  lines = capsys.readouterr().out.splitlines()
  assert lines == [
      f"checkpoint step 2 is corrupt: checkpoints/2/default/{name}: {what}",
      "moved checkpoints/2 to checkpoints.corrupt/2; restored step 1, the newest checkpoint "
      "that verifies"]
  # Kept, out of orbax's sight: the run saves its step 2 again.
  assert os.path.isdir(os.path.join(directory + ".corrupt", "2", "default"))
  assert restorer.latest_step() == 1
  restorer.save(2, _state(2))
  restorer.close()
  _assert_equal(Checkpointer(directory).restore(_like()), _state(2))


def test_a_checkpoint_without_checksums_restores_as_before(tmp_path, capsys):
  directory = _saved_before_checksums(tmp_path)
  _assert_equal(Checkpointer(directory).restore(_like()), _state(2))
  assert capsys.readouterr().out == ""


def test_what_orbax_cannot_read_is_one_line_and_the_step_before_restores(tmp_path, capfd):
  """A checkpoint saved before checksums, with a truncated data file: TensorStore's error in
  one line, not hundreds of lines of tracebacks."""
  directory = _saved_before_checksums(tmp_path)
  _truncate(os.path.join(directory, "2", "default", _largest(os.path.join(directory, "2"))))

  _assert_equal(Checkpointer(directory).restore(_like()), _state(1))
  out, err = capfd.readouterr()
  first, second = out.splitlines()
  assert first.startswith("checkpoint step 2 is unreadable: ValueError: OUT_OF_RANGE: ")
  assert second.startswith("moved checkpoints/2 to checkpoints.corrupt/2; restored step 1")
  assert "Traceback" not in err and "Exception ignored" not in err


def test_no_checkpoint_that_verifies_is_a_clear_error_and_nothing_moves(tmp_path, capsys):
  directory = _saved(tmp_path)
  names = {step: _largest(os.path.join(directory, str(step))) for step in (1, 2)}
  for step, name in names.items():
    _flip(os.path.join(directory, str(step), "default", name))

  restorer = Checkpointer(directory)
  with pytest.raises(CheckpointCorrupt) as raised:
    restorer.restore(_like())
  message = str(raised.value)
  assert message.startswith(f"no checkpoint in {directory} restores, nothing was moved: ")
  for step, name in names.items():
    assert f"checkpoint step {step} is corrupt: checkpoints/{step}/default/{name}: " \
           "sha256 differs" in message
  assert sorted(os.listdir(directory)) == ["1", "2"]
  assert not os.path.exists(directory + ".corrupt")
  # A step asked for by number is not replaced by another.
  with pytest.raises(CheckpointCorrupt, match=f"^checkpoint step 1 is corrupt: "
                     f"checkpoints/1/default/{names[1]}: sha256 differs$"):
    restorer.restore(_like(), step=1)
  assert capsys.readouterr().out == ""


def test_params_alone_fall_back_too_and_move_nothing(tmp_path, capsys):
  """restore_params (evaluation, another run's start) reads what may be another run's
  directory: it falls back, and leaves the files where they are."""
  directory = _saved(tmp_path)
  _flip(os.path.join(directory, "2", "default", _largest(os.path.join(directory, "2"))))
  _assert_equal(Checkpointer(directory).restore_params(), _state(1)["train"]["params"])
  assert capsys.readouterr().out.splitlines()[-1] == (
      "restored step 1, the newest checkpoint that verifies")
  assert sorted(os.listdir(directory)) == ["1", "2"]


# The quickstart recipe shrunk as experiments/configs/tiny.gin shrinks it (2 RL steps).
TINY_QUICKSTART = dict(
    task=Arithmetic(digits=1, operands=2),
    model=lambda vocab: config.tiny(vocab, hidden_size=32, intermediate_size=64),
    rl=RLConfig(num_steps=2, learning_rate=1e-4, prompts_per_step=4, samples_per_prompt=4,
                minibatches=2, max_new_tokens=16, seq_len=32),
    start=trainer.WarmStart(steps=5, batch_size=16, learning_rate=3e-3),
    hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16), checkpoint_every=1,
                        progress=False))


def test_a_run_resumes_from_the_step_before_a_corrupt_checkpoint(tmp_path, capsys):
  run_dir = str(tmp_path / "run")
  trainer.train(run_dir, **TINY_QUICKSTART)
  directory = os.path.join(run_dir, "checkpoints")
  assert sorted(os.listdir(directory)) == ["1", "2"]
  saved = Checkpointer(directory)
  at_1 = saved.restore_params(1)
  saved.close()
  name = _largest(os.path.join(directory, "2"))
  _flip(os.path.join(directory, "2", "default", name))
  capsys.readouterr()

  run = trainer.build(run_dir, **TINY_QUICKSTART)
  try:
    out = capsys.readouterr().out
    assert f"checkpoint step 2 is corrupt: checkpoints/2/default/{name}: sha256 differs\n" \
           "moved checkpoints/2 to checkpoints.corrupt/2; restored step 1, the newest " \
           "checkpoint that verifies\n" in out
    assert f"resuming from {run_dir} at RL step 1" in out
    assert int(run.state.step) == 1
    _assert_equal(run.state.train.params, at_1)
  finally:
    run.close()
  assert os.path.isdir(os.path.join(run_dir, "checkpoints.corrupt", "2"))
