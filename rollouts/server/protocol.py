"""SGLang's wire protocol as our server speaks it (sglang 0.5.23): the fields a /generate body
may hold and SGLang's refusals of the others (BadRequest: its contract gate; RequestError:
refused later; InternalError: what it answers 500), the Requests a body expands into (a batch
and n > 1, rids, sampling settings, log-prob and routing options), the context-length check,
a request's images and the response shape. It owns no state: the scheduler runs what it
makes.

Images (a qwen2_5_vl checkpoint; rollouts/image_data.py and docs/sglang.md 3(j) cite SGLang's
lines): /generate takes `image_data` in the forms SGLang's HTTP server reads that need no
network (a data URL, bare base64, an absolute path or a file:// URL; an http(s) URL is a 400
here, as a download that fails is there), one item, a list per prompt or a list of lists,
normalised as io_struct.py's GenerateReqInput._normalize_image_data. input_ids hold each image
as one image token between vision start and end; the server preprocesses the image as the
trainer does (models/vision.py, the checkpoint's pixel bounds), expands its token to one per
merged patch (base_processor.py _expand_input_ids, SGLANG_MM_AVOID_RETOKENIZE), prefills with
the vision tower and multimodal RoPE positions and decodes on from the largest position + 1;
`return_prompt_token_ids` returns the expanded ids (tokenizer_manager.py generate_request). As
SGLang started without --skip-tokenizer-init: more placeholders than images ("Prompt has 2
image placeholders but 1 image inputs were provided"), a prompt already expanded
(transformers' count check), an undecodable image or an unreachable URL answer 400 {"error":
{"message"}} worded as SGLang's, an image file it cannot open a 500; more images than
placeholders run on the first ones, with a warning; a model without a vision tower ignores
image_data (SGLang runs no multimodal processor for it). (With --skip-tokenizer-init SGLang's
legacy loader would take an expanded run as one placeholder: this server stays strict, so that
a client that forgets to collapse its prompts fails here as it would on the default path.) The
prefix cache keys a prompt's images by a digest of their pixels, as SGLang's radix cache by
their hash. Prompt scoring (logprob_start_len >= 0) with images is not served.
"""

import dataclasses
import hashlib
import os
import sys
import threading
import time
import uuid
from typing import Any, Sequence

from models import vision
from models.config import VisionConfig
from rollouts import image_data
from rollouts.decoding import GREEDY_BELOW

SAMPLING_KEYS = {  # api_types.SamplingParams: anything else is a 400, as in SGLang
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice"}
# Keys this server accepts only at their neutral values (anything else is a 400 naming them).
NEUTRAL = {"stop": (None, "", []), "stop_regex": (None, "", []), "json_schema": (None,),
           "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": ({},),
           "choice": ([],), "beam_width": (None, 1), "watermark": (None,),
           "frequency_penalty": (0.0,), "presence_penalty": (0.0,),
           "repetition_penalty": (1.0,), "min_p": (0.0,), "top_k": (-1, 1073741824),
           "min_new_tokens": (0,)}
# What /release_memory_occupation releases when it names no tags: SGLang's
# GPU_MEMORY_ALL_TYPES (constants.py L2-10). There are no CUDA graphs here: that tag is kept
# for the bookkeeping only.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class BadRequest(ValueError):
  """Answered with HTTP 400 and {"error": message} (SGLang's contract gate, http_server.py
  L937-939)."""


class SchedulerCrash(RuntimeError):
  """What takes an SGLang server down (its scheduler process raised, scheduler.py
  L6370-6380): the calls made to the server fail, and launched from the command line the
  process exits."""


class RequestError(ValueError):
  """Answered with HTTP 400 and {"error": {"message": message}}: a request the contract let
  through refused later (http_server.py L988-990, `_create_error_response` L2246)."""


class InternalError(RuntimeError):
  """Answered with HTTP 500 and the text "Internal Server Error", the message on stderr: an
  exception other than a ValueError out of SGLang's request handling, which its HTTP server
  does not catch (http_server.py serve_generate_request catches ValueError only), e.g. an
  image file it cannot open (base_processor.py _load_single_item)."""


@dataclasses.dataclass
class Request:
  rid: str
  input_ids: list[int]
  max_new_tokens: int
  temperature: float
  top_p: float
  stop_token_ids: tuple[int, ...]
  seed: int
  return_logprob: bool
  logprob_start_len: int = -1  # >= 0: also the log-probs of input tokens from there on
  return_routed_experts: bool = False  # with --enable-return-routed-experts: meta_info's
  routed_experts_start_len: int = 0  # routed_experts, from this input position on
  top_logprobs_num: int = 0  # > 0 (scoring only): also the top tokens at each input position
  input_logprobs: list = dataclasses.field(default_factory=list)  # [logprob | None, token]
  input_top_logprobs: list = dataclasses.field(default_factory=list)  # [[logprob, token]] | None
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[str] = dataclasses.field(default_factory=list)
  finish_reason: dict | None = None
  aborted: str | None = None  # the abort message once aborted
  abort_sent: bool = False  # an abort by its rid came (SGLang passes on only the first)
  cached_tokens: int = 0  # input tokens whose keys and values came from the prefix cache
  # A mixture's experts of each token fed so far (prompt, then generated), i32[sparse
  # layers, k] each, when the server records them.
  routes: list = dataclasses.field(default_factory=list)
  routed_experts: str | None = None  # meta_info's, once finished (Scheduler._finish)
  # A vision-language model's: the prompt's images in the order of its runs of image tokens
  # (input_ids holds them expanded), and a digest of each one's pixels, which the prefix cache
  # keys them by (as SGLang's radix cache keys image tokens by their image's hash).
  images: list = dataclasses.field(default_factory=list)
  image_key: tuple[str, ...] = ()
  return_prompt_token_ids: bool = False  # the response carries input_ids, as expanded
  adapter: Any = None  # the LoRA adapter it names (adapters.Served), None: the base
  started: float = dataclasses.field(default_factory=time.time)
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class Pending:
  """A rid whose /generate call is still reading its images (Scheduler.register)."""
  abort_sent: bool = False


def body_rids(body: dict) -> list[str]:
  """The rids a /generate body names: its list of rids, or its rid for one prompt (a batch
  under one rid, or no rid, gets rids made here, which no abort can name yet)."""
  rid, ids = body.get("rid"), body.get("input_ids")
  if isinstance(rid, list):
    return [r for r in rid if isinstance(r, str)]
  batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
  return [rid] if isinstance(rid, str) and not batched else []


def derived_context_length(hf_config: dict) -> int:
  """SGLang's context length for a config.json without --context-length
  (srt/utils/hf_transformers/common.py L668-694): the first of its length keys, times a rope
  scaling factor that has no original_max_position_embeddings and is not llama3's."""
  rope = hf_config.get("rope_scaling") or {}
  factor = 1 if ("original_max_position_embeddings" in rope
                 or rope.get("rope_type") == "llama3") else rope.get("factor", 1)
  for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
              "max_position_embeddings"):
    if hf_config.get(key) is not None:
      return int(factor * hf_config[key])
  return 2048


def context_error(r: "Request", context_length: int) -> str | None:
  """SGLang's refusal of a request too long for the server (tokenizer_manager.py
  L1337-1377, without --allow-auto-truncate), or None."""
  given = len(r.input_ids)
  if given >= context_length:
    return (f"The input ({given} tokens) is longer than the model's context length "
            f"({context_length} tokens).")
  if given + r.max_new_tokens > context_length:
    return (f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {given + r.max_new_tokens} "
            f"tokens: {given} tokens from the input messages and {r.max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit.")
  return None


def _parse_sampling(params: dict) -> dict:
  if not isinstance(params, dict):
    raise BadRequest("sampling_params must be an object")
  unknown = sorted(set(params) - SAMPLING_KEYS)
  if unknown:
    raise BadRequest(f"unknown field `{unknown[0]}` in SamplingParams")
  for key in ("max_new_tokens", "n", "sampling_seed"):
    if params.get(key) is not None and (type(params[key]) is not int):
      raise BadRequest(f"invalid type for `{key}`, expected an integer")
  used = [k for k, neutral in NEUTRAL.items() if k in params and params[k] not in neutral]
  if used:
    raise BadRequest(f"this server does not implement sampling_params {sorted(used)}")
  top_p = float(params.get("top_p", 1.0))
  if not 0 < top_p <= 1:
    raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
  if params.get("max_new_tokens", 128) < 0:
    raise BadRequest("max_new_tokens must be >= 0")
  return params


def _rids(rid, count: int, batched: bool) -> list[str]:
  """The rid of each of `count` prompts: as given, `rid_i` for a batch under one rid, or
  fresh uuids (io_struct.py L563-564)."""
  if batched and isinstance(rid, list):
    if len(rid) != count:
      raise BadRequest("rid list length must match the batch size")
    rids = rid
  elif batched:
    rids = [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(count)]
  else:
    rids = [rid or uuid.uuid4().hex]
  return rids  # a list naming one rid twice was refused when its rids were registered


def _listed(body: dict, key: str, default, count: int, n: int) -> list:
  """body[key] (`default` when absent or null) for each of `count` prompts: one value for
  all or, with n == 1, a list of one per prompt (io_struct.py _normalize_logprob_params)."""
  value = body.get(key)
  value = default if value is None else value
  if not isinstance(value, list):
    return [value] * count
  if n > 1 or len(value) != count:
    raise BadRequest(f"a list-valued {key} needs n == 1 and one entry per prompt")
  return value


def expand_images(ids: list[int], items: list, v: VisionConfig
                  ) -> tuple[list[int], list[vision.PatchedImage]]:
  """(`ids` with each image's token expanded, the images preprocessed) of one prompt and its
  image_data items, as SGLang's Qwen2.5-VL processor makes them from input_ids
  (rollouts/image_data.py has its lines). Its placeholders are runs vision start, image
  tokens, vision end: as many as images, each must be one image token (its fast path);
  fewer, the images past them are dropped with a warning and the runs taken as one token
  each (its legacy path, whose re-tokenization is the identity here); more, a ValueError
  naming both counts (base_processor.py legacy_load_mm_data). Image tokens other than one per
  image fail transformers' count check (processing_utils.py validate_inputs), as a prompt
  already expanded does. ValueError (400) and RuntimeError (500) as image_data.load_all."""
  start, image, end = v.vision_start_token_id, v.image_token_id, v.vision_end_token_id
  runs = image_data.wrapped_runs(ids, start, image, end)
  if runs < len(items):  # base_processor.py submit_data_loading_tasks
    print("rollouts.server: Warning: More image data items provided than corresponding "
          "tokens found in the prompt.", file=sys.stderr, flush=True)
  pictures = image_data.load_all(items[:runs], fast=runs == len(items))
  if runs > len(items):
    raise ValueError(f"Prompt has {runs} image placeholders but {len(items)} image inputs "
                     "were provided")
  if runs != len(items):
    ids = image_data.collapse(ids, image)
  if ids.count(image) != len(pictures):
    raise ValueError("The total number of <|image_pad|> tokens in the prompts should be the "
                     "same as the number of images passed. Found total "
                     f"{ids.count(image)} <|image_pad|> tokens and {len(pictures)} images.")
  patched = [vision.preprocess(picture, v) for picture in pictures]
  counts = [t * h * w // v.merge for t, h, w in (im.grid for im in patched)]
  return image_data.expand(ids, counts, image), patched


def _images_of(body: dict, prompts: list, batched: bool, v: VisionConfig | None) -> list:
  """Each prompt's (input ids, images) from the body's image_data: expanded with its images
  (expand_images), or as sent where it has none or the model no vision tower (SGLang runs no
  multimodal processor then and ignores image_data: tokenizer_manager.py
  _tokenize_one_request). Errors answered as SGLang's."""
  try:
    items = image_data.per_prompt(body.get("image_data"), len(prompts), batched)
  except image_data.ContractError as e:
    raise BadRequest(str(e)) from None
  except ValueError as e:
    raise RequestError(str(e)) from None
  try:
    return [expand_images(list(p), its, v) if its and v is not None else (list(p), [])
            for p, its in zip(prompts, items)]
  except ValueError as e:
    raise RequestError(str(e)) from None
  except RuntimeError as e:
    raise InternalError(str(e)) from None


def image_key(images: list[vision.PatchedImage]) -> tuple[str, ...]:
  """A digest of each image's grid and pixels."""
  return tuple(hashlib.blake2b(repr(im.grid).encode() + im.patches.tobytes(),
                               digest_size=16).hexdigest() for im in images)


def expand_request(body: dict, deterministic: bool = False, eos_ids: Sequence[int] = (),
                   vision_cfg: VisionConfig | None = None) -> tuple[list[Request], bool]:
  """The Requests of a /generate body (a batch and n > 1 expanded, prompt-major) and
  whether the response is a list. `sampling_seed` is honoured only `deterministic`, and a
  request without one then samples from seed 42, as SGLang does (its sampler gets seeds only
  with --enable-deterministic-inference: sampling/sampling_batch_info.py L157-172). Requests
  stop at the model's `eos_ids` too (checkpoint_eos_ids). A vision-language model's
  (`vision_cfg`) take their image_data (_images_of)."""
  if "text" in body or "input_embeds" in body:
    raise BadRequest("this server is token-in, token-out: send input_ids (it runs as with "
                     "--skip-tokenizer-init)")
  ids = body.get("input_ids")
  if not isinstance(ids, list) or not ids:
    raise BadRequest("input_ids must be a non-empty list of token ids or a list of lists")
  batched = isinstance(ids[0], list)
  prompts = ids if batched else [ids]
  for prompt in prompts:
    if not prompt or not all(type(t) is int for t in prompt):
      raise BadRequest("every prompt in input_ids must be a non-empty list of integers")
  sampling = body.get("sampling_params") or {}
  per_item = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
  if len(per_item) != len(prompts):
    raise BadRequest("sampling_params list length must match the batch size")
  per_item = [_parse_sampling(s) for s in per_item]
  n = per_item[0].get("n", 1) or 1
  if any((s.get("n", 1) or 1) != n for s in per_item):
    raise BadRequest("n must be the same in every sampling_params")
  rids = _rids(body.get("rid"), len(prompts), batched)
  return_logprob = _listed(body, "return_logprob", False, len(prompts), n)
  start_len = _listed(body, "logprob_start_len", -1, len(prompts), n)
  if not all(isinstance(s, int) and not isinstance(s, bool) for s in start_len):
    raise BadRequest("logprob_start_len must be an integer")
  top_num = _listed(body, "top_logprobs_num", 0, len(prompts), n)
  if not all(type(k) is int and k >= 0 for k in top_num):
    raise BadRequest("top_logprobs_num must be an integer >= 0")
  # One value for the whole batch, copied into each request (io_struct.py L1000-1002).
  routes_start = body.get("routed_experts_start_len", 0)
  if type(routes_start) is not int:
    raise BadRequest("routed_experts_start_len must be an integer")
  if type(body.get("return_prompt_token_ids", False)) is not bool:
    raise BadRequest("invalid type for `return_prompt_token_ids`, expected a boolean")
  # n > 1 makes even one prompt a batch (io_struct.py _handle_parallel_sampling).
  inputs = _images_of(body, prompts, batched or n > 1, vision_cfg)
  requests = []
  for (prompt, images), params, item_rid, want_logprob, start, top in zip(
      inputs, per_item, rids, return_logprob, start_len, top_num):
    if top and (params.get("max_new_tokens", 128) > 0 or start < 0 or not want_logprob):
      # Top-k of the prompt's tokens is teacher scoring's; generation does not need it.
      raise BadRequest("top_logprobs_num > 0 is served for prompt scoring only "
                       "(max_new_tokens 0, return_logprob, logprob_start_len >= 0)")
    if images and want_logprob and start >= 0:
      raise BadRequest("this server does not score prompts with images (logprob_start_len "
                       ">= 0 with image_data)")
    key = image_key(images)
    for _ in range(n):
      requests.append(_request(params, prompt, deterministic, eos_ids, images=images,
                               image_key=key, rid=item_rid if n == 1 else uuid.uuid4().hex,
                               return_logprob=bool(want_logprob), logprob_start_len=start,
                               top_logprobs_num=top,
                               return_routed_experts=bool(body.get("return_routed_experts",
                                                                   False)),
                               routed_experts_start_len=routes_start,
                               return_prompt_token_ids=body.get("return_prompt_token_ids",
                                                                False)))
  return requests, batched or n > 1


def _request(params: dict, prompt: list[int], deterministic: bool, eos_ids: Sequence[int],
             **fields) -> Request:
  """One Request of `prompt` under sampling `params`; `fields`: the rest of Request's."""
  temperature = float(params.get("temperature", 1.0))
  seed = params.get("sampling_seed") if deterministic else None
  seed = 42 if deterministic and seed is None else seed
  return Request(
      input_ids=list(prompt), max_new_tokens=int(params.get("max_new_tokens", 128)),
      temperature=0.0 if temperature < GREEDY_BELOW else temperature,
      top_p=float(params.get("top_p", 1.0)),
      stop_token_ids=() if params.get("ignore_eos") else tuple(
          params.get("stop_token_ids") or ()) + tuple(eos_ids),
      seed=(int(seed) % 2**32 if seed is not None
            else int.from_bytes(os.urandom(4), "little")),
      **fields)


def response(r: Request, weight_version: str) -> dict:
  """A finished (or, streaming, a running) request in SGLang's GenerateResponse shape."""
  spans, start = [], 0
  for i in range(1, len(r.versions) + 1):
    if i == len(r.versions) or r.versions[i] != r.versions[start]:
      spans.append({"version": r.versions[start], "start": start, "end": i})
      start = i
  # No tokens: one empty span at the version it started on (utils/weight_versions.py L95-106).
  spans = spans or [{"version": weight_version, "start": 0, "end": 0}]
  meta = {"id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": len(r.input_ids),
          "completion_tokens": len(r.tokens), "cached_tokens": r.cached_tokens,
          "reasoning_tokens": 0,
          "num_retractions": 0,
          "weight_version": r.versions[-1] if r.versions else weight_version,
          "weight_versions": spans, "e2e_latency": time.time() - r.started}
  if r.finish_reason and r.finish_reason["type"] == "abort" \
      and r.finish_reason.get("message") == "Abort in waiting queue":
    del meta["prompt_tokens"], meta["cached_tokens"]
  if r.return_logprob:
    meta["input_token_logprobs"] = [[lp, t, None] for lp, t in r.input_logprobs]
    if r.top_logprobs_num:
      meta["input_top_logprobs"] = [None if row is None else [[lp, t, None] for lp, t in row]
                                    for row in r.input_top_logprobs]
      meta["output_top_logprobs"] = []
    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.tokens)]
    meta["output_token_logprobs_length"] = len(r.tokens)
  if r.routed_experts is not None:
    meta["routed_experts"] = r.routed_experts
  out = {"output_ids": list(r.tokens), "meta_info": meta}
  if r.return_prompt_token_ids:  # the ids after the images' expansion (tokenizer_manager.py
    out["prompt_token_ids"] = list(r.input_ids)  # generate_request, _handle_batch_output)
  return out


def memory_tags(body: dict) -> list[str] | None:
  """The `tags` of a release or resume body (ReleaseMemoryOccupationReqInput, io_struct.py
  L2177-2190): a list of strings, or none."""
  tags = body.get("tags")
  if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
    raise BadRequest(f"tags must be a list of strings (of {', '.join(MEMORY_TAGS)}), got "
                     f"{tags!r}")
  return tags
