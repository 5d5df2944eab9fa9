"""A vision-language model of one's own (rl/pretrained.py's HFCheckpoint on a qwen2_5_vl
directory): a tiny Qwen2.5-VL written by transformers, with a BPE tokenizer trained here and
Qwen2.5-VL's chat template (experiments/tiny_checkpoint.py). Its prompts with images equal
what transformers' processor makes of the same chat; the tiny GRPO recipe trains it on math
problems rendered as images; and the export is a directory transformers' processor and model
load, with the run's logits."""

import io
import json
import os
import subprocess
import types

import jax
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from experiments import tiny_checkpoint
from models import vision
from models.tokenizer import WithImages
from rl.checkpoint import Checkpointer
from rl.pretrained import HFCheckpoint
from rl.rollout import prompt_ids
from rl.tasks.math import MathTask
from rl.tasks.visual import Rendered
from tests.test_pretrained import _command
from tests.test_vision import our_logits

pytestmark = pytest.mark.xdist_group("vision_pretrained")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """The tiny Qwen2.5-VL as transformers initialised it (no SFT: these tests need no skill)."""
  return tiny_checkpoint.make(str(tmp_path_factory.mktemp("qwen2_5_vl")), family="qwen2_5_vl",
                              sft_steps=0, progress=False)


def rendered(checkpoint: str) -> Rendered:
  return Rendered(MathTask(train_path=f"{checkpoint}/data/train.jsonl",
                           test_path=f"{checkpoint}/data/test.jsonl",
                           fields={"problem": "question"}))


def processor_inputs(directory: str, task: Rendered, record: dict) -> dict:
  """What transformers' Qwen2.5-VL processor of `directory` makes of the chat its users
  write (an image part, then the text that follows the image in our prompt): the tokenizer's
  chat template, the image processor's patches, the placeholder's image token repeated as
  Qwen2_5_VLProcessor.replace_image_token says, and which tokens are the image's (the
  processor itself will not build here: its video processor needs torchvision)."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
  text = task.prompt(record).split(vision.IMAGE_MARKER, 1)[1]
  chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
  prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  image = image_processor(images=[Image.open(io.BytesIO(record["images"][0]))],
                          return_tensors="pt")
  expanded = transformers.Qwen2_5_VLProcessor.replace_image_token(
      types.SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>"),
      image, 0)
  ids = torch.tensor([tokenizer.encode(prompt.replace("<|image_pad|>", expanded, 1),
                                      add_special_tokens=False)])
  image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")  # its return_mm_token_type_ids
  return {"input_ids": ids, "mm_token_type_ids": (ids == image_token).int(), **image}


def test_prompts_with_images_equal_the_processors(checkpoint):
  model = HFCheckpoint(checkpoint, dtype="float32")
  cfg = model(0)
  assert cfg.family == "qwen2_5_vl"
  assert (cfg.vision.min_pixels, cfg.vision.max_pixels) == (tiny_checkpoint.MIN_PIXELS,
                                                            tiny_checkpoint.MAX_PIXELS)
  tokenizer = WithImages(model.tokenizer(), cfg.vision)
  task = rendered(checkpoint)
  for record in (task.test[0], task.train[5]):
    want = processor_inputs(checkpoint, task, record)
    assert prompt_ids(task, tokenizer, record) == want["input_ids"][0].tolist()
    patched = vision.preprocess(record["images"][0], cfg.vision)
    np.testing.assert_allclose(patched.patches, want["pixel_values"].numpy(), atol=1e-6)


# tiny/sizes.gin's RLConfig.learning_rate. Adam's first steps move an element whose gradient
# is well above its eps (1e-8) by about this much each: two steps of a real gradient moved
# some element of every parameter array by 1.96 to 2 times it; two steps on zero advantages,
# whose gradients are rounding (grad_norm under 1e-8), moved none by more than 0.75 times it
# (measured).
LEARNING_RATE = 2e-4


def test_the_recipe_trains_it_on_rendered_problems_and_exports_it(checkpoint, tmp_path):
  """Two steps of the tiny GRPO recipe on rendered problems train the decoder and the vision
  tower (RLConfig.freeze_vision is off): each step has a gradient, and every parameter array
  of both moved by an update's worth. The untrained model answers nothing right: in groups
  of several samples all its rewards are equal and GRPO's advantages, so its gradient, 0
  (grad_norm 0.0, measured). In groups of one, which have no baseline (mean 0, std 1, as
  verl), a wrong answer's reward is its advantage, here -1 (DAPO's +1 / -1 correctness):
  every sample is pushed down."""
  run_dir = str(tmp_path / "run")
  command = _command(checkpoint, run_dir, "--gin_param", "train.task = @Rendered()",
                     "--gin_param", "Rendered.task = @MathTask()",
                     "--gin_param", "RLConfig.num_steps = 2",
                     "--gin_param", "RLConfig.prompts_per_step = 16",
                     "--gin_param", "RLConfig.samples_per_prompt = 1",
                     "--gin_param", "Objective.reward = @rewards.correctness()",
                     "--gin_param", "rewards.correctness.incorrect = -1.0",
                     "--gin_param", "RLConfig.seq_len = 192",
                     "--gin_param", "Evaluation.records = 8")
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.load(open(os.path.join(run_dir, "summary.json")))
  assert summary["steps"] == 2 and summary["init_from"] == checkpoint
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    steps = [m for m in map(json.loads, f) if "reward" in m]
  assert [m["step"] for m in steps] == [1, 2]
  assert all(m["reward"] == -1.0 and m["grad_norm"] > 1e-3 for m in steps), steps
  saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
  start, trained = saved.restore_params(0), saved.restore_params()
  saved.close()
  assert set(start) == {"embed_tokens", "layers_0", "layers_1", "norm", "visual"}
  for part in start:  # the decoder's and the tower's
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         start[part], trained[part])
    assert min(jax.tree.leaves(moved)) > 1.5 * LEARNING_RATE, (part, moved)

  export = os.path.join(run_dir, "hf")
  for name in ("preprocessor_config.json", "chat_template.json", "tokenizer.json"):
    assert os.path.isfile(os.path.join(export, name)), name
  task = rendered(checkpoint)
  record = task.test[0]
  inputs = processor_inputs(export, task, record)
  hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(export).eval()
  with torch.no_grad():
    want = hf_model(**inputs).logits[0].numpy()
  cfg = HFCheckpoint(export, dtype="float32")(0)
  saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
  params = saved.restore_params()
  saved.close()
  ids = inputs["input_ids"][0].tolist()
  [[ours]] = our_logits(params, cfg, [[(ids, [vision.preprocess(record["images"][0],
                                                                cfg.vision)])]], len(ids) + 4)
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
