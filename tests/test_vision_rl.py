"""Images through the RL stack on a tiny vision-language model (a small tower in front of the
quickstart's decoder): prompts with image placeholders, SFT on them, the embedded engine's
rollouts, packed batches with each row's images, and a train step whose log-probs equal the
engine's."""

import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image

from models import transformer, vision
from models.config import tiny, tiny_vision
from models.tokenizer import VISION_ALPHABET, VISION_SPECIALS, CharTokenizer, WithImages
from rl import batch as batch_lib
from rl import eval as eval_lib
from rl import loop, losses, rollout, sft
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rl.tasks.mixture import Mixture
from rl.tasks.visual import Rendered, Scenes
from rl.train_step import init_train_state, make_train_step
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

pytestmark = pytest.mark.xdist_group("vision")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VISION = os.path.join(ROOT, "experiments/configs/vision.gin")


def run_cli(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments/run.py"), *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=600)

def tiny_vision_language():
  """(tokenizer, cfg): a CharTokenizer with Qwen2.5-VL's placeholder tokens, and the tiny
  decoder behind a tiny tower whose image tokens are those."""
  chars = CharTokenizer(VISION_ALPHABET, VISION_SPECIALS)
  cfg = tiny(chars.vocab_size, vision=tiny_vision())
  assert chars.encode(vision.PLACEHOLDER) == [cfg.vision.vision_start_token_id,
                                              cfg.vision.image_token_id,
                                              cfg.vision.vision_end_token_id]
  return WithImages(chars, cfg.vision), cfg


def test_prompt_ids_expand_each_image_to_its_grid():
  tokenizer, cfg = tiny_vision_language()
  task = Rendered(Arithmetic())
  record = task.train[0]
  ids = rollout.prompt_ids(task, tokenizer, record)
  grid = vision.preprocess(record["images"][0], cfg.vision).grid
  v = cfg.vision
  assert ids.count(v.image_token_id) == grid[0] * grid[1] * grid[2] // 4 > 0
  first = ids.index(v.image_token_id)
  assert ids[first - 1] == v.vision_start_token_id
  assert ids[first + ids.count(v.image_token_id)] == v.vision_end_token_id
  assert tokenizer.decode(ids).endswith(task.instruction)
  with pytest.raises(ValueError, match="the model takes no images"):
    rollout.prompt_ids(task, tokenizer.tokenizer, record)
  bad = dict(record, images=record["images"] * 2)
  with pytest.raises(ValueError, match="1 <image> markers for its 2 images"):
    rollout.prompt_ids(task, tokenizer, bad)


def test_sft_rollouts_and_train_step_with_images():
  tokenizer, cfg = tiny_vision_language()
  task = Rendered(Arithmetic(digits=1))
  scenes = Scenes("count", max_difficulty=2)
  params = transformer.init_params(cfg, jax.random.key(0))
  before = jax.tree.map(np.asarray, params["visual"])
  params, loss = sft.fit(params, cfg, lambda i: sft.solution_example(task, tokenizer,
                                                                      task.train[i]),
                         32, steps=3, batch_size=4, seq_len=64, progress=False)
  assert np.isfinite(loss)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                       params["visual"], before)
  assert max(jax.tree.leaves(moved)) > 0  # the tower trains with the decoder
  engine = JaxEngine(cfg, params, min_batch=4)
  records = [task.train[i] for i in range(2)] + [scenes.train[0]]
  trajectories = []
  for i, record in enumerate(records):  # Rendered and Scenes prompts in one step's batch
    which = task if i < 2 else scenes
    made = rollout.generate(engine, which, tokenizer, [record],
                            SamplingParams(max_new_tokens=6, stop_token_ids=(tokenizer.eos_id,)),
                            samples=2, seed=i)
    for t in made:
      t.group = i
    trajectories += made
  config = RLConfig(seq_len=96, row_multiple=2, micro_batches=2)
  masks = batch_lib.train_masks(trajectories, np.ones(len(trajectories), bool))
  batches = batch_lib.minibatches(trajectories, np.linspace(-1, 1, len(trajectories)), masks,
                                  config, vision_cfg=cfg.vision)
  batch = batches[0]
  assert batch.positions.shape == (*batch.tokens.shape, 3)
  assert batch.images.pixels.shape[0] == batch.tokens.shape[0]
  # every prompt placeholder, and nothing else, is a slot of its row's images
  slots = batch.images.slots
  assert np.all(batch.tokens[np.nonzero(slots < vision.NOWHERE)[0], slots[slots < vision.NOWHERE]]
                == cfg.vision.image_token_id)
  placeholders = sum(len(vision.placeholder_slots(t.prompt_ids, cfg.vision))
                     for t in trajectories)
  assert (slots < vision.NOWHERE).sum() == (batch.images.image[:, ::4] != 0).sum() == placeholders
  step = make_train_step(cfg, optax.sgd(1e-2), losses.bind("grpo"), micro_batches=2)
  state, metrics = step(init_train_state(params, optax.sgd(1e-2)),
                        jax.tree.map(jnp.asarray, batch), params)  # grpo's KL: a reference
  # the engine's log-probs (images prefilled, decoding on past them) are the trainer's
  assert float(metrics["logp_diff_max"]) < 1e-4
  assert float(metrics["kl_to_reference"]) < 1e-6  # the reference, with images, is the policy
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def test_a_frozen_tower_keeps_its_weights_while_the_decoder_moves():
  tokenizer, cfg = tiny_vision_language()
  task = Rendered(Arithmetic(digits=1), cell=14, font_size=20)
  params = transformer.init_params(cfg, jax.random.key(1))
  examples = [sft.solution_example(task, tokenizer, task.train[i]) for i in range(4)]
  batch = next(sft.sft_batches(lambda i: examples[i], 4, batch_size=4, seq_len=64, seed=0,
                               row_multiple=2, vision_cfg=cfg.vision))
  batch = jax.tree.map(jnp.asarray, batch.replace(advantages=batch.loss_mask))
  optimizer = loop.rl_optimizer(1e-2, frozen=("visual",))
  step = make_train_step(cfg, optimizer, losses.bind("k1.5"))
  state, _ = step(init_train_state(params, optimizer), batch)
  moved = lambda key: max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(jnp.abs(a - b).max()), state.params[key], params[key])))
  assert moved("visual") == 0.0 and moved("layers_0") > 0.0


def test_rendered_cells_put_one_glyph_in_each_patch_column():
  task = Rendered(Arithmetic(), cell=14, font_size=20)
  record = task.train[0]
  text = task.text_prompt(record)
  pixels = np.asarray(Image.open(io.BytesIO(record["images"][0])).convert("L"))
  assert pixels.shape[1] % 28 == 0 and pixels.shape[0] % 28 == 0
  ink = pixels[:28] < 128  # the text line fills the first row of merge blocks
  assert not (pixels[28:] < 128).any()
  columns = [ink[:, 14 * k:14 * (k + 1)].any() for k in range(pixels.shape[1] // 14)]
  assert columns == [k < len(text) for k in range(len(columns))]


def test_greedy_eval_reports_each_mixture_tasks_accuracy():
  tokenizer, cfg = tiny_vision_language()
  task = Mixture({"rendered": Rendered(Arithmetic(digits=1), cell=14, font_size=20),
                  "text": Arithmetic(digits=1)})
  engine = JaxEngine(cfg, transformer.init_params(cfg, jax.random.key(2)))
  metrics = eval_lib.greedy_eval(engine, task, tokenizer, num_records=4, max_new_tokens=4)
  assert set(metrics) >= {"accuracy", "accuracy_rendered", "accuracy_text"}
  assert metrics["accuracy"] == (metrics["accuracy_rendered"] + metrics["accuracy_text"]) / 2


@pytest.mark.parametrize("params,message", [
    (["train.tokenizer = @CharTokenizer()"], "the tokenizer encodes the image placeholder"),
    (["tiny.vision = None"], "the model takes no images"),
    (["RLConfig.freeze_vision = True", "tiny.vision = None", "train.task = @Arithmetic()"],
     "freeze_vision: the model \\(qwen2\\) has no vision tower"),
])
def test_vision_configurations_that_cannot_run_are_refused(params, message, tmp_path):
  result = run_cli("--gin", VISION, "--run_dir", str(tmp_path / "run"),
                   *[a for p in params for a in ("--gin_param", p)])
  assert result.returncode != 0 and re.search(message, result.stderr), result.stderr[-2000:]


def test_the_vision_config_runs_sft_rl_and_reports_each_task(tmp_path):
  """experiments/configs/vision.gin shrunk to a few steps: the mixture of rendered
  arithmetic, the same problems as text and counting scenes, through the warm start, an RL
  step and both evaluations; its last line names each task's accuracy."""
  run_dir = tmp_path / "run"
  result = run_cli("--gin", VISION, "--run_dir", str(run_dir), "--gin_param",
                   "Hooks.progress = False", "--gin_param", "WarmStart.steps = 4",
                   "--gin_param", "RLConfig.num_steps = 1", "--gin_param",
                   "RLConfig.prompts_per_step = 6", "--gin_param",
                   "RLConfig.samples_per_prompt = 2", "--gin_param", "Evaluation.records = 6",
                   "--gin_param", "Evaluation.every = 0", "--gin_param",
                   "RLConfig.freeze_vision = True")
  assert result.returncode == 0, result.stderr[-3000:]
  last = result.stdout.strip().splitlines()[-1]
  for name in ("rendered", "text", "scenes"):
    assert re.search(f"sft_accuracy_{name}=[0-9.]+ rl_accuracy_{name}=[0-9.]+", last), last
  summary = json.loads((run_dir / "summary.json").read_text())
  assert "rl_accuracy_rendered" in summary
