"""Qwen2.5-VL (models/vision.py, the qwen2_5_vl family): preprocessing equal to transformers'
image processor, logits equal to Qwen2_5_VLForConditionalGeneration's on prompts with one and
two images (padded and packed rows), multimodal RoPE ids equal to get_rope_index, and an
export that transformers loads."""

import copy
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models import hf, transformer, vision
from models.config import VisionConfig
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

pytestmark = pytest.mark.xdist_group("vision")

IMAGE, VIDEO, START, END = 290, 291, 292, 293
# 56 px windows: 2 x 2 merge blocks, so the test images span several windows
HF_CONFIG = dict(
    text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                      "rope_theta": 10000.0}),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                       out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
    vision_end_token_id=END)
BOUNDS = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 24)


def picture(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
  """A random image (smooth enough that bicubic resampling does something)."""
  rng = np.random.default_rng(seed)
  small = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
  return Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR).convert(mode)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny random Qwen2.5-VL written by transformers, with its preprocessor_config.json."""
  path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
  torch.manual_seed(0)
  model = transformers.Qwen2_5_VLForConditionalGeneration(
      transformers.Qwen2_5_VLConfig(**HF_CONFIG)).float().eval()
  with torch.no_grad():  # transformers initialises norms to one: make them count
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
        p.uniform_(0.5, 1.5)
  model.save_pretrained(path)
  Qwen2VLImageProcessorPil(size={"shortest_edge": BOUNDS["min_pixels"],
                                 "longest_edge": BOUNDS["max_pixels"]}).save_pretrained(path)
  return path, model


def hf_processor():
  return Qwen2VLImageProcessorPil(size={"shortest_edge": BOUNDS["min_pixels"],
                                        "longest_edge": BOUNDS["max_pixels"]})


def test_preprocessing_equals_transformers_image_processor(checkpoint):
  cfg = hf.read_config(checkpoint[0])
  assert (cfg.vision.min_pixels, cfg.vision.max_pixels) == tuple(BOUNDS.values())
  images = [picture(60, 90, 0), picture(120, 50, 1), picture(300, 200, 2),  # scaled down
            picture(20, 30, 3),  # scaled up
            picture(70, 70, 4, "RGBA"), picture(64, 100, 5, "L")]
  for image in images:
    ref = hf_processor()(images=[image], return_tensors="np")
    ours = vision.preprocess(image, cfg.vision)
    assert ours.grid == tuple(ref["image_grid_thw"][0]), image.size
    np.testing.assert_allclose(ours.patches, ref["pixel_values"], atol=1e-6, rtol=0)
  buffer = io.BytesIO()
  images[0].save(buffer, format="PNG")
  from_bytes = vision.preprocess(buffer.getvalue(), cfg.vision)
  np.testing.assert_array_equal(from_bytes.patches, vision.preprocess(images[0], cfg.vision)[0])
  # a group's prompts share their image objects: each is preprocessed once, and equal
  each = vision.preprocess_each([[images[0]], [images[0], images[1]], [], [images[0]]],
                                cfg.vision)
  assert [len(ims) for ims in each] == [1, 2, 0, 1]
  assert each[0][0] is each[1][0] is each[3][0]
  np.testing.assert_array_equal(each[1][1].patches,
                                vision.preprocess(images[1], cfg.vision).patches)
  with pytest.raises(TypeError, match="an image must be"):
    vision.preprocess(3.0, cfg.vision)
  with pytest.raises(FileNotFoundError, match="no such file"):
    vision.preprocess("/nonexistent/cat.png", cfg.vision)


def prompt(images: list[vision.PatchedImage], texts: list[list[int]]) -> list[int]:
  """texts[0], image 0 (between vision start and end, one image token per merge block),
  texts[1], image 1, ..., texts[-1]."""
  ids = list(texts[0])
  for image, text in zip(images, texts[1:]):
    ids += [START] + [IMAGE] * (image.patches.shape[0] // 4) + [END] + list(text)
  return ids


def hf_logits(model, ids, images: list[vision.PatchedImage]) -> np.ndarray:
  """Qwen2_5_VLForConditionalGeneration's logits f32[L, vocab] for one unpadded prompt."""
  input_ids = torch.tensor([ids])
  kwargs = {}
  if images:
    kwargs = dict(pixel_values=torch.tensor(np.concatenate([im.patches for im in images])),
                  image_grid_thw=torch.tensor([im.grid for im in images]),
                  mm_token_type_ids=(input_ids == IMAGE).int())
  with torch.no_grad():
    return model(input_ids=input_ids, **kwargs).logits[0].float().numpy()


def raw_examples(cfg):
  """(prompt ids, [PIL images]): one image, two images, none."""
  rng = np.random.default_rng(7)
  text = lambda n: list(rng.integers(1, 280, n))
  one, two = [picture(60, 90, 10)], [picture(120, 50, 11), picture(56, 56, 12)]
  patched = lambda ims: [vision.preprocess(im, cfg.vision) for im in ims]
  return [(prompt(patched(one), [text(5), text(7)]), one),
          (prompt(patched(two), [text(3), text(4), text(6)]), two), (text(9), [])]


def examples(cfg):
  """raw_examples with the images preprocessed."""
  return [(ids, [vision.preprocess(im, cfg.vision) for im in ims])
          for ids, ims in raw_examples(cfg)]


def our_logits(params, cfg, rows_of_sequences, width):
  """Our logits for rows each packing some of the (ids, images) sequences (positions from 0 in
  each, multimodal), padded to `width`: a list per row of f32[L, vocab] per sequence."""
  tokens = np.zeros((len(rows_of_sequences), width), np.int32)
  positions = np.zeros((len(rows_of_sequences), width, 3), np.int32)
  segments = np.zeros((len(rows_of_sequences), width), np.int32)
  images, slots, spans = [], [], []
  for r, row in enumerate(rows_of_sequences):
    at, row_spans = 0, []
    for s, (ids, ims) in enumerate(row):
      tokens[r, at:at + len(ids)] = ids
      positions[r, at:at + len(ids)] = vision.mrope_positions(ids, [im.grid for im in ims],
                                                              cfg.vision)
      segments[r, at:at + len(ids)] = s + 1
      images += ims
      slots += [r * width + at + i for i in vision.placeholder_slots(ids, cfg.vision)]
      row_spans.append((at, at + len(ids)))
      at += len(ids)
    spans.append(row_spans)
  batch = vision.batch_images(images, cfg.vision, slots, patches=sum(
      im.patches.shape[0] for im in images) + 8)  # 8 patches of padding
  hidden = jax.jit(transformer.forward, static_argnums=1)(
      params, cfg, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments), batch)
  logits = np.asarray(hidden @ transformer.output_projection(params, cfg))
  return [[logits[r, a:b] for a, b in row] for r, row in enumerate(spans)]


def test_logits_equal_transformers_padded_and_packed(checkpoint):
  path, model = checkpoint
  cfg, params = hf.load(path)
  assert cfg.family == "qwen2_5_vl" and cfg.mrope_section == (2, 3, 3)
  seqs = examples(cfg)
  refs = [hf_logits(model, ids, ims) for ids, ims in seqs]
  padded = our_logits(params, cfg, [[s] for s in seqs], max(len(s[0]) for s in seqs) + 3)
  packed = our_logits(params, cfg, [seqs[:2], seqs[2:]], sum(len(s[0]) for s in seqs))
  for ref, ours in zip(refs, [row[0] for row in padded] + packed[0] + packed[1]):
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
  # the images matter: another picture changes the logits after it
  other = [vision.preprocess(picture(60, 90, 99), cfg.vision)]
  changed = our_logits(params, cfg, [[(seqs[0][0], other)]], len(seqs[0][0]))[0][0]
  assert np.abs(changed - refs[0])[-1].max() > 1e-3


def test_mrope_positions_equal_get_rope_index(checkpoint):
  path, model = checkpoint
  cfg = hf.read_config(path)
  for ids, ims in examples(cfg)[:2]:
    input_ids = torch.tensor([ids])
    ref, delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor([im.grid for im in ims]))
    ours = vision.mrope_positions(ids, [im.grid for im in ims], cfg.vision)
    np.testing.assert_array_equal(ours, ref[:, 0].numpy().T)
    assert ours.max() + 1 - len(ids) == int(delta)
  with pytest.raises(ValueError, match="needs a run of 4 image tokens"):
    vision.mrope_positions([1, IMAGE, IMAGE, 2], [(1, 4, 4)], cfg.vision)
  with pytest.raises(ValueError, match="2 images given"):
    vision.mrope_positions([1, IMAGE, IMAGE, IMAGE, IMAGE], [(1, 4, 4)] * 2, cfg.vision)


def test_export_reloads_in_transformers(checkpoint, tmp_path):
  path, model = checkpoint
  cfg, params = hf.load(path)
  out = hf.save(params, cfg, str(tmp_path / "export"))
  assert hf.read_config(out) == cfg
  reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
  for ids, ims in examples(cfg)[:2]:
    np.testing.assert_allclose(hf_logits(reloaded, ids, ims), hf_logits(model, ids, ims),
                               atol=1e-6, rtol=0)
  processor = transformers.AutoImageProcessor.from_pretrained(out)
  image = picture(60, 90, 0)
  np.testing.assert_allclose(processor(images=[image], return_tensors="np")["pixel_values"],
                             vision.preprocess(image, cfg.vision).patches, atol=1e-6)
  with open(os.path.join(out, "config.json")) as f:  # the hub's layout: text fields on top
    written = json.load(f)
  assert written["rope_scaling"]["mrope_section"] == [2, 3, 3]
  assert written["num_hidden_layers"] == 2 and written["vision_config"]["depth"] == 3


def test_bfloat16_parameters_and_compute(checkpoint, tmp_path):
  """bf16 params and compute, the tower's included: about as far from transformers' float32
  logits as transformers' own model in bf16 is, on prompts with one image, two and none; the
  export holds BF16 tensors that transformers loads."""
  path, model = checkpoint
  cfg, params = hf.load(path, dtype="bfloat16", param_dtype="bfloat16")
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  theirs_bf16 = copy.deepcopy(model).to(torch.bfloat16)
  for ids, ims in examples(cfg):
    want = hf_logits(model, ids, ims)
    ours = our_logits(params, cfg, [[(ids, ims)]], len(ids))[0][0].astype(np.float32)
    theirs = hf_logits(theirs_bf16, ids, ims)
    ours_err, theirs_err = np.abs(ours - want).max(), np.abs(theirs - want).max()
    # measured: 0.0040 / 0.0041 (one image), 0.0057 / 0.0057 (two), 0.0048 / 0.0044 (none)
    assert ours_err < 1.5 * theirs_err, (len(ims), ours_err, theirs_err)
  out = hf.save(params, cfg, str(tmp_path / "bf16"))
  reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      out, dtype=torch.bfloat16)
  assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}


def test_config_refusals():
  good = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
              video_token_id=VIDEO)
  with pytest.raises(ValueError, match="window_size=50 must be a multiple of"):
    VisionConfig(**{**good, "window_size": 50})
  with pytest.raises(ValueError, match="full_attention_blocks"):
    VisionConfig(**{**good, "full_attention_blocks": (2,)})
  config = transformers.Qwen2_5_VLConfig(**HF_CONFIG).to_dict()
  config["vision_config"]["hidden_act"] = "gelu"
  with pytest.raises(hf.CheckpointError, match="hidden_act 'gelu'"):
    hf.config_from_hf(config)


def trainer_logprobs(params, cfg, ids, images, completion) -> np.ndarray:
  """The trainer's log-probs f32[n] of `completion` after prompt `ids` with its `images`:
  the prompt's multimodal positions, then the completion's counting on from the largest."""
  prompt_positions = vision.mrope_positions(ids, [im.grid for im in images], cfg.vision)
  after = prompt_positions.max() + 1 + np.arange(len(completion))
  positions = np.concatenate([prompt_positions, np.repeat(after[:, None], 3, 1)])[None]
  tokens = np.asarray([list(ids) + list(completion)], np.int32)
  hidden = transformer.forward(params, cfg, tokens, positions, np.ones_like(tokens),
                               vision.batch_images(images, cfg.vision,
                                                   vision.placeholder_slots(ids, cfg.vision))
                               if images else None)
  logp = jax.nn.log_softmax(hidden[0] @ transformer.output_projection(params, cfg))
  return np.asarray(logp[np.arange(len(ids) - 1, tokens.shape[1] - 1), tokens[0, len(ids):]])


def test_engine_logprobs_equal_the_trainers_and_greedy_equals_transformers(checkpoint):
  path, model = checkpoint
  cfg, params = hf.load(path)
  engine = JaxEngine(cfg, params, min_batch=2, min_prompt_len=8)
  raw = raw_examples(cfg)
  prompts, images = [ids for ids, _ in raw], [ims for _, ims in raw]
  sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=3, images=images)
  for (ids, ims), done in zip(examples(cfg), sampled):
    assert len(done.token_ids) == 8
    np.testing.assert_allclose(done.logprobs, trainer_logprobs(params, cfg, ids, ims,
                                                               done.token_ids), atol=1e-4)
  greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0), seed=0,
                           images=images)
  for (ids, ims), done in zip(examples(cfg), greedy):
    input_ids = torch.tensor([ids])
    kwargs = {} if not ims else dict(
        pixel_values=torch.tensor(np.concatenate([im.patches for im in ims])),
        image_grid_thw=torch.tensor([im.grid for im in ims]),
        mm_token_type_ids=(input_ids == IMAGE).int())
    with torch.no_grad():
      ref = model.generate(input_ids=input_ids, max_new_tokens=6, do_sample=False,
                           **kwargs)[0, len(ids):]
    np.testing.assert_array_equal(done.token_ids, ref.numpy())
  with pytest.raises(ValueError, match="images for 1 prompts, 3 given"):
    engine.generate(prompts, SamplingParams(max_new_tokens=2), seed=0, images=images[:1])
