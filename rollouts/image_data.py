"""SGLang's /generate `image_data` at both ends of the wire (sglang 0.5.23, Qwen2.5-VL).

Owns what an image is on HTTP and what a prompt's image placeholders are there
(../shared/reference/formats.md section 4.5):
- the client's side (rollouts/sglang.py): `data_url` (an image as a data URL of its RGB
  pixels in PNG), `collapse` (a trainer's prompt, one image token per merged patch, with
  each image's run of tokens as the one token SGLang expects) and `run_lengths`;
- the server's side (rollouts/server/protocol.py): `per_prompt` (the JSON contract's shapes and
  GenerateReqInput's normalisation into each prompt's items), `load_all` (load_image's
  string forms, its errors worded as SGLang's), `wrapped_runs` and `expand` (the
  placeholders SGLang finds and its _expand_input_ids).
It does not own preprocessing or how many tokens an image takes (models/vision.py), nor the
requests themselves.

SGLang's lines followed (python/sglang/srt/ in its repository):
- shapes: api/v1/api_types.py decode_MediaInput, decode_MediaRef (a string, a MediaRef
  object, a list of them, a list of lists; unknown MediaRef keys are a 400);
- normalisation: managers/io_struct.py GenerateReqInput._normalize_image_data (a lone item is
  every prompt's; a list is one entry per prompt, `[[...], ...]` kept, `[a, b]` wrapped as
  `[[a], [b]]`; another length: "The length of image_data should be equal to the batch
  size."); one request's list is its images (managers/tokenizer_manager.py
  _tokenize_one_request wraps a lone item); an entry of only nulls has none
  (multimodal/mm_utils.py has_valid_data);
- loading: utils/common.py load_image, get_image_bytes, _load_image (http(s) URLs, file://,
  absolute paths, data URLs, bare base64 with validate=True: a relative path is read as
  base64, and fails); multimodal/processors/base_processor.py _load_single_item (a client's
  error, ValueError/UnidentifiedImageError/requests', becomes ValueError "Error while
  loading data ..."; anything else RuntimeError) and fast_load_mm_data / legacy_load_mm_data
  (their prefixes). The HTTP server answers a ValueError with 400 {"error": {"message"}} and
  lets a RuntimeError through as a 500 (entrypoints/http_server.py serve_generate_request,
  _create_error_response). A MediaRef object passes the contract but reaches load_image as
  a dict (GenerateReqInput's image items are `Union[str, bytes, Dict, ImageData, Image]`), which
  it refuses: "Invalid image";
- placeholders: multimodal/processors/qwen_vl.py QwenVLImageProcessor.mm_tokens (the regex
  `<|vision_start|>(<|image_pad|>)+<|vision_end|>`) and base_processor.py
  _expand_input_ids (SGLANG_MM_AVOID_RETOKENIZE, on by default: the caller's ids kept, each
  image token repeated as many times as its image has merged patches).
"""

import base64
import binascii
import io
from typing import Any, Sequence
from urllib.parse import unquote, urlparse

from PIL import Image

MEDIA_REF_FIELDS = ("url", "detail", "max_dynamic_patch", "content_hash", "min_pixels",
                    "max_pixels", "total_max_pixels", "fps", "num_frames", "min_frames",
                    "max_frames", "max_tokens_per_frame", "max_image_tokens", "use_audio",
                    "image_grid_thw")


class ContractError(ValueError):
  """`image_data` outside the JSON contract's shapes: SGLang's gate answers 400
  {"error": message} (http_server.py generate_request)."""


# --- the client's side


def data_url(image) -> str:
  """`image` (anything models.vision.open_image takes: encoded bytes, a path, a PIL image)
  as a data URL of PNG bytes of its RGB pixels. The trainer preprocesses the same RGB pixels
  (models.vision.preprocess converts to RGB): sent as they are, the server could decode a
  JPEG otherwise (SGLang decodes one with nvJPEG on a GPU: utils/common.py _load_image) or
  turn an RGBA image into RGB otherwise (base_processor.py _load_single_item, smart_to_rgb
  when so configured), and see other pixels."""
  from models.vision import open_image  # jax comes with it: a vision-language client's cost
  buffer = io.BytesIO()
  open_image(image).convert("RGB").save(buffer, format="PNG")
  return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def collapse(ids: Sequence[int], image_token_id: int) -> list[int]:
  """`ids` with each run of image tokens (an image's placeholder expanded to one token per
  merged patch) as one image token: what SGLang expands (`expand`)."""
  out = []
  for token in ids:
    if not (token == image_token_id and out and out[-1] == image_token_id):
      out.append(token)
  return out


def run_lengths(ids: Sequence[int], image_token_id: int) -> list[int]:
  """The length of each run of image tokens in `ids`, in order."""
  lengths, previous = [], None
  for token in ids:
    if token == image_token_id:
      if previous == image_token_id:
        lengths[-1] += 1
      else:
        lengths.append(1)
    previous = token
  return lengths


# --- the server's side


def _check_item(item) -> None:
  """ContractError unless `item` is one of api_types.MediaItem's shapes."""
  if isinstance(item, str):
    return
  if not isinstance(item, dict):
    raise ContractError(f"invalid type for an image_data item: {type(item).__name__}, "
                        "expected a string or a MediaRef object")
  unknown = sorted(set(item) - set(MEDIA_REF_FIELDS))
  if unknown:
    raise ContractError(f"unknown field `{unknown[0]}` in MediaRef")
  if not isinstance(item.get("url", ""), str):
    raise ContractError("invalid type for MediaRef `url`, expected a string")


def _check_shape(value) -> None:
  """ContractError unless `value` is one of api_types.MediaInput's shapes (decode_MediaInput:
  a list whose first entry is a list is a list of lists)."""
  if not isinstance(value, list):
    _check_item(value)
    return
  nested = bool(value) and isinstance(value[0], list)
  for entry in value:
    if entry is None:
      continue
    if not nested:
      _check_item(entry)
    elif not isinstance(entry, list):
      raise ContractError("image_data: a list of lists holds lists (or nulls) only")
    else:
      for item in entry:
        if item is not None:
          _check_item(item)


def per_prompt(value: Any, count: int, batched: bool) -> list[list]:
  """Each of `count` prompts' image_data items, as SGLang reads a /generate body's
  `image_data` (`batched`: input_ids is a list of lists, or n > 1, which makes one prompt a
  batch of one: io_struct.py _handle_parallel_sampling). ContractError for a shape the
  contract refuses, ValueError for a list of another length than the batch."""
  if value is None:
    return [[] for _ in range(count)]
  _check_shape(value)
  if not isinstance(value, list):
    lists = [[value]] * count
  elif not value:
    lists = [[]] * count
  elif not batched:
    lists = [value]
  elif len(value) != count:
    raise ValueError("The length of image_data should be equal to the batch size.")
  else:
    lists = value if isinstance(value[0], list) else [[item] for item in value]
  return [[] if not items or all(item is None for item in items) else list(items)
          for items in lists]


def _bytes(item: str) -> bytes:
  """The encoded image `item` names (get_image_bytes, after load_image's file:// case)."""
  if item.startswith(("http://", "https://")):
    # SGLang downloads it (3 s timeout); a download that fails is a client's error (a
    # requests exception: 400). This server has no network to try.
    raise ValueError(f"this server fetches no URLs (no network): {item}")
  if item.startswith("file://"):
    item = unquote(urlparse(item).path)
  if item.startswith("/"):
    with open(item, "rb") as f:  # OSError: not a client's error to SGLang (a 500)
      return f.read()
  if item.startswith("data:"):
    item = item.split(",", 1)[1]
  return base64.b64decode(item, validate=True)


def load(item) -> Image.Image:
  """The image `item` names, RGB, read as SGLang reads a string item (load_image's forms, and
  _load_single_item's conversion to RGB); ValueError where SGLang's error is a client's
  (400), OSError where not (500)."""
  if not isinstance(item, str):
    raise ValueError(f"Invalid image: {item}")
  try:
    data = _bytes(item)
  except (IndexError, binascii.Error) as e:  # "data:" without a comma; not base64
    raise ValueError(str(e)) from None
  try:
    image = Image.open(io.BytesIO(data))
    image.load()
  except (OSError, SyntaxError) as e:
    raise ValueError(f"Could not decode image: {e}") from e
  return image if image.mode == "RGB" else image.convert("RGB")


def load_all(items: Sequence, fast: bool) -> list[Image.Image]:
  """Every item `load`ed, its errors worded as SGLang's: ValueError (a 400) for a client's,
  RuntimeError (a 500) for the rest. `fast`: as many placeholders as images
  (fast_load_mm_data's wording; else legacy_load_mm_data's)."""
  images = []
  for index, item in enumerate(items):
    shown = str(item) if len(str(item)) <= 100 else str(item)[:100] + "..."
    where = (f"An exception occurred while loading IMAGE data at index {index}: " if fast
             else "An exception occurred while loading multimodal data: ")
    try:
      images.append(load(item))
    except ValueError as e:
      raise ValueError(f"{where}Error while loading data {shown}: {e}") from None
    except OSError as e:
      raise RuntimeError(f"{where}Error while loading data {shown}: {e}") from None
  return images


def wrapped_runs(ids: Sequence[int], start: int, image: int, end: int) -> int:
  """How many image placeholders SGLang finds in `ids`: runs of one or more `image` tokens
  between `start` and `end` (qwen_vl.py mm_tokens' regex, on the decoded prompt)."""
  runs, at = 0, 0
  while at < len(ids):
    if ids[at] == start and at + 1 < len(ids) and ids[at + 1] == image:
      after = at + 1
      while after < len(ids) and ids[after] == image:
        after += 1
      if after < len(ids) and ids[after] == end:
        runs += 1
      at = after
    else:
      at += 1
  return runs


def expand(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
  """base_processor.py _expand_input_ids: `ids` with its i-th image token repeated counts[i]
  times (the caller checked there are as many image tokens as counts)."""
  out, images = [], iter(counts)
  for token in ids:
    out += [token] * next(images) if token == image_token_id else [token]
  return out

