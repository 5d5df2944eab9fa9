"""Images through the RL stack on a tiny vision-language model (a small tower in front of the
quickstart's decoder): prompts with image placeholders, SFT on them, the embedded engine's
rollouts, packed batches with each row's images, and a train step whose log-probs equal the
engine's."""

import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import transformer, vision
from models.config import tiny, tiny_vision
from models.tokenizer import DEFAULT_ALPHABET, CharTokenizer, WithImages
from rl import batch as batch_lib
from rl import losses, rollout, sft
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rl.tasks.visual import Rendered, Scenes
from rl.train_step import init_train_state, make_train_step
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

pytestmark = pytest.mark.xdist_group("vision")

SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def tiny_vision_language():
  """(tokenizer, cfg): a CharTokenizer with Qwen2.5-VL's placeholder tokens, and the tiny
  decoder behind a tiny tower whose image tokens are those."""
  chars = CharTokenizer(DEFAULT_ALPHABET + string.ascii_uppercase + "\n'", SPECIALS)
  ids = tuple(chars.encode(s)[0] for s in SPECIALS)  # start, image, end, video
  tower = tiny_vision(128, (ids[1], ids[0], ids[2], ids[3]))
  return WithImages(chars, tower), tiny(chars.vocab_size, vision=tower)


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
