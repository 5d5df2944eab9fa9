"""Qwen2.5-VL's images: preprocessing, the patch layout, the vision tower, multimodal RoPE ids.

Owns what turns an image into decoder inputs, as transformers 5.25's Qwen2.5-VL does
(`image_processing_pil_qwen2_vl.py`, `modeling_qwen2_5_vl.py`; ../shared/reference/formats.md
section 4):
- `preprocess`: RGB, resized (bicubic, PIL) to multiples of patch_size * spatial_merge_size
  pixels with its area in [min_pixels, max_pixels] (`smart_resize`), rescaled by 1/255,
  normalised by CLIP's mean and std, cut into patches block-major: each spatial_merge_size^2
  consecutive patches are one merge block, one token of the decoder.
  `preprocess_each`: a batch's, each distinct image once.
- `Images`: a batch's images as the tower takes them under jit, every image's patches
  concatenated and padded to a fixed count, with each patch's (row, column), image and window.
- `VisionTower`: patch embedding, blocks of 2D-RoPE attention (within windows, or over the
  image in the full-attention blocks) and SwiGLU, the patch merger -> [patches / merge,
  out_hidden_size]. transformers reorders the patches window by window and runs attention
  per window; here every patch stays in place and attends within its window, or its image,
  as a segment of blockwise attention (the same sums: a merge block never straddles windows;
  memory linear in the batch's patches).
- `mrope_positions`: each token's (temporal, height, width) position, transformers'
  get_rope_index: text tokens count on in all three, an image's tokens hold its start in the
  first and start + row, start + column in the others, and text resumes at start +
  max(rows, columns).

The decoder (models/transformer.py) scatters the tower's rows into its image tokens, in order.
"""

import io
import math
import os
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image as PILImage

from models.attention import blockwise
from models.config import VisionConfig
from models.layers import RMSNorm, swiglu


# A task prompt's place for one image (verl's and slime's marker), and what it becomes in
# the text a tokenizer encodes: Qwen2.5-VL's chat template's rendering of an image item.
IMAGE_MARKER = "<image>"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class PatchedImage(NamedTuple):
  """One preprocessed image: patches f32[t * h * w, patch_dim] block-major, grid (t, h, w)
  in patches (t = 1: a still image)."""
  patches: np.ndarray
  grid: tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
  """The (height, width) an image is resized to: multiples of `factor`, the aspect ratio
  kept as closely as can be, the area within [min_pixels, max_pixels] (transformers'
  smart_resize)."""
  if max(height, width) / min(height, width) > 200:
    raise ValueError(f"an image of {width}x{height} pixels: its aspect ratio must be below 200")
  h, w = round(height / factor) * factor, round(width / factor) * factor
  if h * w > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h = max(factor, math.floor(height / beta / factor) * factor)
    w = max(factor, math.floor(width / beta / factor) * factor)
  elif h * w < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
  return h, w


def open_image(image) -> PILImage.Image:
  """A PIL image from what a task record may hold: a PIL image, a path, encoded bytes
  (PNG, JPEG, ...) or an array uint8[H, W, 3]."""
  if isinstance(image, PILImage.Image):
    return image
  if isinstance(image, (str, os.PathLike)):
    if not os.path.exists(image):
      raise FileNotFoundError(f"image {image!r}: no such file")
    return PILImage.open(image)
  if isinstance(image, (bytes, bytearray)):
    return PILImage.open(io.BytesIO(image))
  if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3:
    return PILImage.fromarray(image)
  raise TypeError(f"an image must be a PIL image, a path, encoded bytes or uint8[H, W, 3]; "
                  f"got {type(image).__name__}")


def preprocess(image, cfg: VisionConfig) -> PatchedImage:
  """The patches of `image` (anything `open_image` takes), equal to transformers'
  Qwen2VLImageProcessorPil's pixel_values and image_grid_thw for it."""
  pil = open_image(image).convert("RGB")
  p, m, t = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
  h, w = smart_resize(pil.height, pil.width, p * m, cfg.min_pixels, cfg.max_pixels)
  pixels = np.asarray(pil.resize((w, h), PILImage.Resampling.BICUBIC))  # uint8[h, w, 3]
  # transformers' order of casts: x / 255 in float64, to float32, then (x - mean) / std
  x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
  x = (x - np.float32(cfg.image_mean)[:, None, None]) / np.float32(cfg.image_std)[:, None, None]
  gh, gw = h // p, w // p
  x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
  x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # one frame, t times
  return PatchedImage(np.ascontiguousarray(x.reshape(gh * gw, cfg.patch_dim)), (1, gh, gw))


def preprocess_each(images: Sequence[Sequence], cfg: VisionConfig
                    ) -> list[list[PatchedImage]]:
  """`preprocess` of each prompt's images, each distinct image object once: a group of n
  samples of one prompt repeats its images n times, and decoding and resizing dominate."""
  done: dict[int, PatchedImage] = {}
  for image in (im for ims in images for im in ims):
    if id(image) not in done:
      done[id(image)] = preprocess(image, cfg)
  return [[done[id(im)] for im in ims] for ims in images]


def image_grid(image, cfg: VisionConfig) -> tuple[int, int, int]:
  """The (t, h, w) patch grid `preprocess` gives `image`, from its size alone."""
  if isinstance(image, PatchedImage):
    return image.grid
  pil = open_image(image)
  h, w = smart_resize(pil.height, pil.width, cfg.patch_size * cfg.spatial_merge_size,
                      cfg.min_pixels, cfg.max_pixels)
  return 1, h // cfg.patch_size, w // cfg.patch_size


def expand_image_tokens(ids, grids: list[tuple[int, int, int]], cfg: VisionConfig) -> list[int]:
  """`ids` with each image token (one per image, as the chat template writes it) repeated
  for every decoder token of its image: t * h * w / merge (transformers' processor)."""
  at = [i for i, token in enumerate(ids) if token == cfg.image_token_id]
  if len(at) != len(grids):
    raise ValueError(f"a prompt with {len(at)} image placeholders for {len(grids)} images")
  out, last = [], 0
  for i, (t, h, w) in zip(at, grids):
    out += list(ids[last:i]) + [cfg.image_token_id] * (t * h * w // cfg.merge)
    last = i + 1
  return out + list(ids[last:])


def sequence_positions(prompt, following: int, grids: list[tuple[int, int, int]],
                       cfg: VisionConfig) -> np.ndarray:
  """Multimodal RoPE positions i32[len(prompt) + following, 3] of a prompt with images and
  `following` tokens after it (generated: text, whatever their ids), which count on from the
  prompt's largest position + 1 on all three axes, as the engines decode them."""
  head = mrope_positions(prompt, grids, cfg)
  after = head.max(initial=-1) + 1 + np.arange(following, dtype=np.int32)
  return np.concatenate([head, np.repeat(after[:, None], 3, axis=1)]).astype(np.int32)


class Images(NamedTuple):
  """A batch's images as the tower takes them: every image's patches in order, padded to a
  fixed count (a multiple of the merge, padding in image 0).

  pixels f32[P, patch_dim]; rows_cols i32[P, 2] each patch's row and column in its image;
  image i32[P] 1 + the index of its image (frame), 0 for padding; window i32[P] 1 + the
  index of its attention window over the batch, 0 for padding; slots i32[P / merge] the
  token each merged patch replaces (its index in the tokens flattened), NOWHERE for
  padding. Or each with a leading axis [rows, P, ...]: each packed row's images
  (`row_images`), attended to row by row, slots indexing the tokens of its row.

  The slots are a prompt's placeholders (`placeholder_slots`), never found by token id: an
  image token a policy generated is no placeholder, and one before another sequence's images
  in a packed row would take its place.
  """
  pixels: jax.Array
  rows_cols: jax.Array
  image: jax.Array
  window: jax.Array
  slots: jax.Array


NOWHERE = 2 ** 30  # a slot past any batch's tokens: the scatter drops it


def placeholder_slots(prompt, cfg: VisionConfig) -> list[int]:
  """The indices of `prompt`'s image tokens (its images' placeholders, in order)."""
  return [i for i, token in enumerate(prompt) if token == cfg.image_token_id]


def batch_images(images: list[PatchedImage], cfg: VisionConfig, slots,
                 patches: int | None = None) -> Images:
  """`Images` of `images` in order, their merged patches replacing the tokens at `slots`
  (one per merged patch, in order), padded to `patches` patches (None: no padding)."""
  total = sum(im.patches.shape[0] for im in images)
  if len(slots) * cfg.merge != total:
    raise ValueError(f"batch_images: {len(slots)} image tokens for images of {total} patches "
                     f"({total // cfg.merge} tokens)")
  patches = total if patches is None else patches
  if patches < total or patches % cfg.merge:
    raise ValueError(f"batch_images: room for {patches} patches; the images have {total} "
                     f"and the room must be a multiple of {cfg.merge}")
  pixels = np.zeros((patches, cfg.patch_dim), np.float32)
  rows_cols = np.zeros((patches, 2), np.int32)
  image = np.zeros(patches, np.int32)
  window = np.zeros(patches, np.int32)
  start, frames, windows = 0, 0, 0
  for im in images:
    n = im.patches.shape[0]
    pixels[start:start + n] = im.patches
    rc, frame, win = _patch_layout(im.grid, cfg)
    rows_cols[start:start + n], image[start:start + n] = rc, frames + 1 + frame
    window[start:start + n] = windows + 1 + win
    start, frames, windows = start + n, frames + im.grid[0], windows + win.max() + 1
  placed = np.full(patches // cfg.merge, NOWHERE, np.int32)
  placed[:len(slots)] = slots
  return Images(pixels, rows_cols, image, window, placed)


def row_images(rows: list[tuple[list[PatchedImage], list[int]]], cfg: VisionConfig,
               min_patches: int = 64) -> Images:
  """`Images` with a leading axis: each row's (images, slots in the row), padded to one
  power-of-two count of patches (at least `min_patches`), so that a batch's micro-batches
  split them with its rows."""
  most = max([sum(im.patches.shape[0] for im in ims) for ims, _ in rows] + [1])
  room = max(min_patches, 1 << (most - 1).bit_length())
  per_row = [batch_images(ims, cfg, slots, room) for ims, slots in rows]
  return Images(*(np.stack(field) for field in zip(*per_row)))


def _patch_layout(grid: tuple[int, int, int], cfg: VisionConfig):
  """For the block-major patches of one image of `grid` (t, h, w): (i32[n, 2] row and column,
  i32[n] frame, i32[n] window, windows numbered from 0 frame by frame)."""
  t, h, w = grid
  m = cfg.spatial_merge_size
  rows = np.arange(h).reshape(h // m, m, 1, 1)
  cols = np.arange(w).reshape(1, 1, w // m, m)
  shape = (h // m, m, w // m, m)
  row = np.broadcast_to(rows, shape).transpose(0, 2, 1, 3).reshape(-1)
  col = np.broadcast_to(cols, shape).transpose(0, 2, 1, 3).reshape(-1)
  side = cfg.window_size // m // cfg.patch_size  # a window's side in merge blocks
  across = -(-(w // m) // side)
  per_frame = -(-(h // m) // side) * across
  win = (row // m // side) * across + col // m // side
  frame = np.repeat(np.arange(t), h * w)
  return (np.tile(np.stack([row, col], -1), (t, 1)).astype(np.int32), frame.astype(np.int32),
          (frame * per_frame + np.tile(win, t)).astype(np.int32))


def mrope_positions(tokens, grids: list[tuple[int, int, int]], cfg: VisionConfig,
                    start: int = 0) -> np.ndarray:
  """Each token's multimodal RoPE position (temporal, height, width), transformers'
  get_rope_index for one sequence: `grids` are its images' in order, each image's tokens a
  run of t * h * w / merge image tokens.

  tokens i32[L] -> i32[L, 3], counting from `start`.
  """
  tokens = np.asarray(tokens)
  m = cfg.spatial_merge_size
  out = np.zeros((len(tokens), 3), np.int64)
  at, pos, images = 0, start, iter(grids)
  while at < len(tokens):
    if tokens[at] != cfg.image_token_id:
      out[at], at, pos = pos, at + 1, pos + 1
      continue
    grid = next(images, None)
    if grid is None:
      raise ValueError(f"mrope_positions: an image token at {at} past the {len(grids)} "
                       "images given")
    t, h, w = grid[0], grid[1] // m, grid[2] // m
    n = t * h * w
    if tokens[at:at + n].size != n or np.any(tokens[at:at + n] != cfg.image_token_id):
      raise ValueError(f"mrope_positions: the image at token {at}, grid {tuple(grid)}, needs a "
                       f"run of {n} image tokens")
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    out[at:at + n] = pos + np.stack([tt, hh, ww], -1).reshape(n, 3)
    at, pos = at + n, pos + max(h, w)
  if next(images, None) is not None:
    raise ValueError(f"mrope_positions: {len(grids)} images given, fewer runs of image tokens")
  return out.astype(np.int32)


class VisionBlock(nn.Module):
  cfg: VisionConfig
  dtype: jnp.dtype
  param_dtype: str

  @nn.compact
  def __call__(self, x, cos, sin, segments):
    """x [B, P, hidden]; cos, sin f32[B, P, head_dim]; segments i32[B, P] (0: padding; a
    patch attends to its segment's patches) -> [B, P, hidden]"""
    c = self.cfg
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype,
                                     name=name)
    heads, d = c.num_heads, c.hidden_size // c.num_heads
    y = RMSNorm(1e-6, self.param_dtype, name="norm1")(x)
    qkv = dense(3 * c.hidden_size, "qkv")(y).reshape(*x.shape[:2], 3, heads, d)
    q, k, v = (qkv[:, :, i] for i in range(3))

    def turn(a):  # f32 rotation, as transformers', then back to the compute dtype
      a = a.astype(jnp.float32)
      a1, a2 = jnp.split(a, 2, axis=-1)
      rotated = a * cos[:, :, None] + jnp.concatenate([-a2, a1], -1) * sin[:, :, None]
      return rotated.astype(x.dtype)

    out = blockwise.attention(turn(q), turn(k), v, segments, causal=False)
    x = x + dense(c.hidden_size, "proj")(out.reshape(*x.shape[:2], c.hidden_size))
    y = RMSNorm(1e-6, self.param_dtype, name="norm2")(x)
    mlp = lambda name, n: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype,
                                   name=name)
    hidden = swiglu(mlp("gate_proj", c.intermediate_size)(y),
                    mlp("up_proj", c.intermediate_size)(y))
    return x + mlp("down_proj", c.hidden_size)(hidden)


class VisionTower(nn.Module):
  """Images -> f32[P / merge, out_hidden_size]: one row per decoder image token, in order
  (the padding's rows last)."""
  cfg: VisionConfig
  dtype: str = "float32"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, images: Images):
    c, dtype = self.cfg, jnp.dtype(self.dtype)
    if images.pixels.ndim == 2:  # one batch of patches
      images = Images(*(x[None] for x in images))
    dense = lambda n, name, bias=True: nn.Dense(n, use_bias=bias, dtype=dtype,
                                                param_dtype=self.param_dtype, name=name)
    x = dense(c.hidden_size, "patch_embed", bias=False)(images.pixels.astype(dtype))
    d = c.hidden_size // c.num_heads
    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))
    angles = (images.rows_cols[..., None].astype(jnp.float32)
              * jnp.asarray(inv_freq, jnp.float32)).reshape(*x.shape[:2], d // 2)  # rows' first
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))
    # Attention within segments, the image or the window, in linear memory (blockwise
    # tiles; tiles of other images and far windows skipped): a dense [P, P] mask over a
    # batch's patches took 25 GB for 256 small rendered problems.
    for i in range(c.depth):
      segments = images.image if i in c.full_attention_blocks else images.window
      x = VisionBlock(c, dtype, self.param_dtype, name=f"blocks_{i}")(x, cos, sin, segments)
    x = RMSNorm(1e-6, self.param_dtype, name="merger_ln_q")(x)
    x = x.reshape(-1, c.merge * c.hidden_size)  # the rows' merged patches, row after row
    x = nn.gelu(dense(c.merge * c.hidden_size, "merger_mlp_0")(x), approximate=False)
    return dense(c.out_hidden_size, "merger_mlp_2")(x)
