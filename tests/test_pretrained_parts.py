"""A run from a pretrained Hugging Face checkpoint (rl/pretrained.py) with the parts of
today's runs: teachers from a Hugging Face directory scoring its trajectories (on-policy
distillation), two JAX processes reading the checkpoint into their shards (as one process
would, step for step) and training, checkpointing and exporting, and bf16 master weights and
AdamW moments (HFCheckpoint.param_dtype). All on the untrained tiny Qwen2 of
experiments/tiny_checkpoint.py (sft_steps=0)."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from experiments import tiny_checkpoint
from models import hf, transformer
from rl import distill, hooks as hooks_lib, rewards, trainer
from rl.checkpoint import Checkpointer
from rl.config import RLConfig
from rl.pretrained import HFCheckpoint
from rl.tasks.math import MathTask
from tests.test_distributed import ROOT, finish, start

# A step's worth of rollouts at the size of a CPU test.
SIZES = dict(num_steps=3, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16,
             seq_len=128, learning_rate=1e-3, temperature=1.0)


def alternating() -> rewards.RewardTransform:
  """Reward 1 for every other sample: the untrained checkpoint is never right (and a
  truncated answer never scores), and an RL step needs rewards that vary within a group to
  have a gradient."""

  def update(rollouts, state, *, step):
    del step
    alternate = jnp.arange(rollouts.reward.shape[0]) % 2
    return rollouts.replace(reward=alternate.astype(jnp.float32)), state

  return rewards.RewardTransform(lambda: (), update)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return tiny_checkpoint.make(str(tmp_path_factory.mktemp("qwen2")), family="qwen2",
                              sft_steps=0, progress=False)


def _task(checkpoint: str) -> MathTask:
  return MathTask(train_path=f"{checkpoint}/data/train.jsonl",
                  test_path=f"{checkpoint}/data/test.jsonl", fields={"problem": "question"})


def _hooks() -> trainer.Hooks:
  return trainer.Hooks(evaluation=trainer.Evaluation(records=8), progress=False,
                       tensorboard=False)


def _continuation_logprobs(params, cfg, prompt, continuation) -> np.ndarray:
  """f32[len(continuation)]: log p(token | the tokens before it) under `params`, one row."""
  tokens = jnp.asarray([list(prompt) + list(continuation)])
  hidden = transformer.forward(params, cfg, tokens, jnp.arange(tokens.shape[1])[None],
                               jnp.ones_like(tokens))
  logp = np.asarray(jax.nn.log_softmax(hidden[0] @ transformer.output_projection(params, cfg)))
  return logp[len(prompt) - 1:-1][np.arange(len(continuation)), continuation]


def test_teachers_from_a_hugging_face_directory_score_an_hfcheckpoint_run(tmp_path,
                                                                          checkpoint):
  """Objective(loss='opd') with teachers read from Hugging Face directories, on a run whose
  model is an HFCheckpoint: the student's own checkpoint as the teacher scores every token as
  the student sampled it (no gap, no gradient); a sharper teacher (its final norm x4: the
  student's logits x4) scores the tokens as its params do, and its gap drives the update."""
  cfg, params = hf.load(checkpoint)
  sharper = hf.save({**params, "norm": jax.tree.map(lambda x: 4 * x, params["norm"])}, cfg,
                    str(tmp_path / "sharper"), copy_from=checkpoint)
  _, sharper_params = hf.load(sharper)
  first = {}
  for name, teacher in (("self", checkpoint), ("sharper", sharper)):
    objective = trainer.Objective(loss="opd", teachers=lambda cfg, teacher=teacher: (
        distill.from_checkpoints(cfg, paths={"t": teacher}, routes={"*": "t"})))
    run = trainer.build(str(tmp_path / name), task=_task(checkpoint),
                        model=HFCheckpoint(checkpoint, dtype="float32"),
                        rl=RLConfig(**SIZES), objective=objective, hooks=_hooks())
    steps = run.steps()
    try:
      records = [next(steps) for _ in range(2)]
    finally:
      steps.close()
      run.close()
    metrics = records[0].metrics
    assert metrics["teacher_version/t"] == 0 and metrics["teacher_share/t"] == 1.0
    assert all(np.isfinite(r.metrics["loss"]) for r in records)
    first[name] = metrics, records[0].trajectories

  metrics, _ = first["self"]
  assert abs(metrics["student_teacher_kl"]) < 1e-5, metrics
  assert abs(metrics["teacher_minus_student"]) < 1e-5 and metrics["grad_norm"] < 1e-4, metrics

  metrics, trajectories = first["sharper"]
  gaps = [np.asarray(t.logprobs) - _continuation_logprobs(sharper_params, cfg, t.prompt_ids,
                                                           t.token_ids) for t in trajectories]
  want = float(np.concatenate(gaps).mean())
  assert want > 0.1  # a different policy: the student's samples are unlikely under it
  np.testing.assert_allclose(metrics["student_teacher_kl"], want, rtol=1e-4)
  np.testing.assert_allclose(metrics["teacher_minus_student"], -want, rtol=1e-3)
  assert metrics["grad_norm"] > 1e-2, metrics


# Run on 1 or 2 JAX processes (tests.test_distributed.start): the checkpoint's params read
# into their shards on a mesh over all devices (HFCheckpoint.initial, the trainer's start),
# compared shard by shard with the directory's tensors; three SFT steps on the mesh from them
# (WarmStart over a pretrained model); with a run directory, an RL run on the mesh from the
# checkpoint (GRPO: its KL reads the reference, the directory read again into shards).
PROCESSES_SCRIPT = """
import json, sys
from models import distributed
distributed.initialize()
import jax
import numpy as np
from models import hf, sharding
from rl import sft, trainer
from rl.config import RLConfig
from rl.pretrained import HFCheckpoint
from tests.test_pretrained_parts import SIZES, _hooks, _task, alternating
path, out = sys.argv[1], sys.argv[2]
checkpoint = HFCheckpoint(path, dtype="float32")
cfg = checkpoint(0)
mesh = sharding.make_mesh(fsdp=4)
params = checkpoint.initial(cfg, mesh, seed=0)
_, whole = hf.load(path, cfg)
held = 0  # elements of the checkpoint this process holds
for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(whole)):
  want, pieces = np.asarray(want), {}
  for shard in got.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    pieces[str(shard.index)] = shard.data.size
  held += sum(pieces.values())
examples = sft.read_demonstrations(f"{path}/data/sft.jsonl", checkpoint.tokenizer())
tuned, loss = sft.fit(params, cfg, examples.__getitem__, len(examples), steps=3, batch_size=8,
                      seq_len=128, progress=False, mesh=mesh)
l1 = sum(float(np.abs(np.asarray(x)).sum())
         for x in jax.tree.leaves(distributed.local_copy(tuned)))
if len(sys.argv) > 3:
  trainer.train(sys.argv[3], task=_task(path), model=checkpoint,
                rl=RLConfig(**{**SIZES, "num_steps": 2}),
                objective=trainer.Objective(loss="grpo", reward=alternating()), mesh=mesh,
                hooks=_hooks())
if distributed.is_primary():
  json.dump({"held": held, "total": sum(np.size(x) for x in jax.tree.leaves(whole)),
             "loss": loss, "l1": l1}, open(out, "w"))
"""


@pytest.mark.slow
def test_two_processes_read_an_hf_checkpoint_into_their_shards_and_train(tmp_path,
                                                                         checkpoint):
  script = tmp_path / "processes.py"
  script.write_text(f"import sys; sys.path.insert(0, {ROOT!r})\n" + PROCESSES_SCRIPT)
  run_dir = str(tmp_path / "run")
  log = finish(start([str(script), checkpoint, str(tmp_path / "two.json"), run_dir], 2, 2,
                     tmp_path, "two"), tmp_path, "two")
  finish(start([str(script), checkpoint, str(tmp_path / "one.json")], 1, 4, tmp_path, "one"),
         tmp_path, "one")
  two, one = (json.load(open(tmp_path / f"{n}.json")) for n in ("two", "one"))
  # Each of two processes holds half of every sharded tensor; one process holds them all.
  assert one["held"] == one["total"] and two["held"] < 0.6 * two["total"], (one, two)
  # The SFT steps from the sharded checkpoint: the same global computation.
  np.testing.assert_allclose([two["loss"], two["l1"]], [one["loss"], one["l1"]], rtol=1e-5)

  # The RL run on two processes: it starts from the checkpoint (its step-0 checkpoint holds
  # the directory's tensors, and the reference is the start: no KL at step 1), trains, and
  # exports its final params.
  assert "2 processes" in log
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2]  # written once, by process 0
  assert abs(records[1]["kl_to_reference"]) < 1e-6 and records[1]["grad_norm"] > 0, records[1]
  assert records[2]["kl_to_reference"] > 0, records[2]
  saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
  started, final = saved.restore_params(0), saved.restore_params(2)
  saved.close()
  _, want = hf.load(checkpoint)
  for got, expected in zip(jax.tree.leaves(started), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(started),
                                                      jax.tree.leaves(final)))
  _, exported = hf.load(os.path.join(run_dir, "hf"))
  for got, expected in zip(jax.tree.leaves(exported), jax.tree.leaves(final)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_bf16_master_weights_and_moments_train_and_export(tmp_path, checkpoint):
  """HFCheckpoint.param_dtype='bfloat16': the params and AdamW's moments are bf16 from the
  load through the steps, the loss stays finite, and the export is a bf16 Hugging Face
  directory holding the final params, which transformers loads with longrl's logits."""
  import torch
  import transformers
  model = HFCheckpoint(checkpoint, dtype="bfloat16", param_dtype="bfloat16")
  run_dir = str(tmp_path / "run")
  run = trainer.build(run_dir, task=_task(checkpoint), model=model, rl=RLConfig(**SIZES),
                      objective=trainer.Objective(loss="grpo", reward=alternating()),
                      hooks=_hooks())
  try:
    start = [np.asarray(x) for x in jax.tree.leaves(run.state.train.params)]
    hooks_lib.drive(run)
    train = run.state.train
    floats = [x for x in jax.tree.leaves(train) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.bfloat16)}
    assert len(floats) == 3 * len(start)  # the params, and the two moments of each
    final = [np.asarray(x) for x in jax.tree.leaves(train.params)]
  finally:
    run.close()
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records), records
  assert any(not np.array_equal(a, b) for a, b in zip(start, final))  # not rounded away

  export = os.path.join(run_dir, "hf")
  assert json.load(open(os.path.join(export, "config.json")))["torch_dtype"] == "bfloat16"
  with safe_open(os.path.join(export, "model.safetensors"), "np") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  cfg, exported = hf.load(export)  # float32 compute over the exported bf16 weights
  for got, want in zip(jax.tree.leaves(exported), final):
    np.testing.assert_array_equal(np.asarray(got).astype(ml_dtypes.bfloat16), want)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      export, dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()
  hidden = transformer.forward(exported, cfg, jnp.asarray(tokens), jnp.arange(20)[None],
                               jnp.ones((2, 20), jnp.int32))
  got = np.asarray(hidden @ transformer.output_projection(exported, cfg))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
