"""The embedded JAX engine served over HTTP with SGLang's native protocol (sglang 0.5.23).

Owns a step-wise scheduler (requests are decoded one token at a time in batches, so abort,
pause and weight updates take effect between tokens) and the subset of SGLang's endpoints a
trainer uses, with SGLang's request checks and response shapes (../shared/reference/sglang.md
sections 1-2): /generate (single and batch, n, stream, return_logprob), /abort_request (a live
rid, or all; partial output), /pause_generation (abort, retract, in_place),
/continue_generation, /update_weights_from_disk, /update_weight_version, /flush_cache,
/release_memory_occupation, /resume_memory_occupation (a hybrid deployment's turns: weights and
KV cache freed while the trainer runs), /model_info, /server_info, /health, /health_generate,
/ready, /v1/loads, and return_routed_experts (a mixture's, with
--enable-return-routed-experts). It lets the SGLang client (rollouts/sglang.py) run for real
in CI, where SGLang itself cannot, and behaves as SGLang where a client can go wrong
(docs/sglang.md, section 3): an unknown rid's abort does nothing, a live rid is refused, the
entry at logprob_start_len is null, /health generates (so it blocks while paused or updating),
requests arriving while paused or updating wait outside the scheduler, sampling_seed counts
only with --deterministic, --dtype auto serves float32 in float16, requests stop at the
checkpoint's eos ids, and a release while busy, a resume of what was not released, or a
request or weight load on released memory takes the server down. A quantized checkpoint (FP8
blocks or compressed-tensors INT4, models/hf.py) is served as SGLang serves it: its projections
held as stored, dequantized at every step (the model's unpack_projections); a refit of an INT4
one takes the server down, as it takes SGLang's (rollouts/sglang.py refusals). A /generate
call's rids are registered before its images are read, so an abort meanwhile is lost, as in
SGLang (Scheduler.register); a request whose input + max_new_tokens exceed --context-length
(default config.json's) is refused with SGLang's 400 (context_error); --api-key and
--admin-api-key guard the calls as SGLang's do (Server.refuses).

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

Log-probs follow SGLang: log_softmax(logits / temperature) over the whole vocabulary
(raw log_softmax when greedy). `retract` keeps the frozen batch's KV instead of recomputing it.

  python -m rollouts.server --hf_checkpoint DIR [--host 127.0.0.1] [--port 0]
                           [--max_batch 64] [--warmup_len TOKENS] [--deterministic]
                           [--dtype auto|float32|bfloat16|float16]
                           [--enable-memory-saver] [--enable-weights-cpu-backup]
                           [--enable-return-routed-experts] [--context-length N]
                           [--api-key KEY] [--admin-api-key KEY]
  python -m experiments.serve --gin FILE [--gin_param B] [the options above]

(the second serves a model bound in gin, e.g. `load_model.model = @tiny`: gin is the entry
point's business, and this module imports nothing above rollouts/)

prints "listening on http://HOST:PORT" once it serves. Batch shapes (rows, prompt width, cache
length) come from short ladders so that a server compiles few; --warmup_len compiles all of
them for requests up to that many tokens before serving. `launch(...)` starts it as a
subprocess and waits for /health. LONGRL_SERVER_DEBUG=1 logs each batch's size to stderr.

--deterministic (SGLang's --enable-deterministic-inference; on by default when the environment
has LONGRL_DETERMINISTIC=1, which rl.trainer.make_deterministic sets for the servers a
reproducible run starts): a request's tokens and log-probs depend on the request alone (its
input_ids, sampling params and sampling_seed), never on which requests share its batch or the
order they arrived in. Every request is sampled from its own sampling_seed (42 when it has
none, as SGLang's); what else is in the batch changes the shapes a row is computed in (rows,
prompt width, cache length), and with them the order of the sums in its matmuls and
attention. Deterministic, a batch holds only requests of one prompt-width and one
max_new_tokens bucket (so a row is laid out the same whatever the others are), always has
max_batch rows, aborted requests' keys and values are not reused (a resumed request is
prefilled like a fresh one), and each prompt scored (max_new_tokens 0) is scored alone. The
price is in small batches, computed in max_batch rows: on a CPU, 8 requests take about twice
as long on the quickstart's model; full ones, and a trainer's steps, nothing measurable
(BUILD.md, "Reproducible runs").
"""

import argparse
import base64
import dataclasses
import functools
import hashlib
import hmac
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import hf, host_allocator, quantize, transformer, vision
from models.config import ModelConfig, VisionConfig
from models.tokenizer import checkpoint_eos_ids
from rollouts import image_data
from rollouts import router as router_lib
from rollouts import sglang
from rollouts.jax_engine import (bucket, categorical, nucleus, score_continuations,
                                 score_continuations_top_k)

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
GREEDY_BELOW = 1e-6
GATHER_SECONDS = 0.01
PREFIX_CACHE_ENTRIES = 1024
# What /release_memory_occupation releases when it names no tags: SGLang's
# GPU_MEMORY_ALL_TYPES (constants.py L2-10). There are no CUDA graphs here: that tag is kept
# for the bookkeeping only.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def shape_bucket(n: int, minimum: int) -> int:
  """The smallest of minimum x (1, 1.5, 2, 3, 4, 6, 8, ...) that is >= n: powers of two and 1.5x
  powers of two, so that a server meets few batch shapes (each a compile of seconds on a CPU)
  while, above the minimum, less than a third of a bucket is padding."""
  power = bucket(n, minimum)
  return power * 3 // 4 if power >= 2 * minimum and n <= power * 3 // 4 else power


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


def prompt_images(ids: list[int], items: list, v: VisionConfig
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
  (prompt_images), or as sent where it has none or the model no vision tower (SGLang runs no
  multimodal processor then and ignores image_data: tokenizer_manager.py
  _tokenize_one_request). Errors answered as SGLang's."""
  try:
    items = image_data.per_prompt(body.get("image_data"), len(prompts), batched)
  except image_data.ContractError as e:
    raise BadRequest(str(e)) from None
  except ValueError as e:
    raise RequestError(str(e)) from None
  try:
    return [prompt_images(list(p), its, v) if its and v is not None else (list(p), [])
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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill(params, prompts, positions, kv_valid, cache, images=None, *, cfg):
  """(next-token logits, cache, a mixture's experts of the prompt tokens i32[rows, width,
  sparse layers, k] or None). `images`: the prompts' (vision.Images), positions then
  i32[rows, width, 3]."""
  hidden, cache, routes = transformer.prefill(params, cfg, prompts, positions,
                                              kv_valid[:, :prompts.shape[1]].astype(jnp.int32),
                                              cache, images)
  return (hidden[:, -1] @ transformer.output_projection(params, cfg), cache,
          None if routes is None else routes.experts)


@functools.partial(jax.jit, static_argnums=2)
def _grow(cache, kv_valid, extra: int):
  """The cache and its validity mask with `extra` more (empty) slots at the end."""
  pad = lambda x: jnp.pad(x, [(0, 0)] * 2 + [(0, extra), (0, 0)])  # the slot axis
  return (transformer.KVCache(*(tuple(map(pad, layers)) for layers in cache)),
          jnp.pad(kv_valid, [(0, 0), (0, extra)]))


@jax.jit
def _request_keys(seeds):
  return jax.vmap(jax.random.PRNGKey)(seeds)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _step(params, logits, cache, kv_valid, keys, temperature, top_p, positions, slot, active,
          i, *, cfg):
  """Choose token i of each row (per-row temperature, top-p and PRNG key), score it as
  SGLang does, and run the decode step that feeds it back (a mixture's experts of it:
  i32[rows, sparse layers, k], or None)."""
  keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
  greedy = temperature < GREEDY_BELOW
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  # The nucleus sorts the whole vocabulary of every row: only when some row asks for it.
  cut = jax.lax.cond(jnp.any(top_p < 1.0),
                     lambda: jnp.where((top_p < 1.0)[:, None], nucleus(scaled, top_p[:, None]),
                                       scaled),
                     lambda: scaled)
  sampled = jax.vmap(lambda k, l: categorical(k, l[None])[0])(keys, cut)
  token = jnp.where(greedy, jnp.argmax(logits, -1), sampled).astype(jnp.int32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], -1)[:, 0]
  kv_valid = kv_valid.at[:, slot].set(active)
  hidden, cache, routes = transformer.decode(params, cfg, token[:, None], positions[:, None],
                                             kv_valid, cache, slot)
  return (token, logp, hidden[:, 0] @ transformer.output_projection(params, cfg), cache,
          kv_valid, None if routes is None else routes.experts[:, 0])


@dataclasses.dataclass
class CachedPrefix:
  """The keys and values of an aborted request's tokens (prompt + generated, all fed to the
  model): f32[num_layers, num_kv_heads, n, head_dim] each, the logits for the next token
  f32[vocab] and, when the server records them, a mixture's experts of the n tokens
  (i32[n, sparse layers, k]: a cache hit returns the routes recorded when the prefix was
  computed, as SGLang's, whose capture buffer is indexed by KV slot). A request resumed with
  exactly these tokens as input_ids skips its prefill."""
  k: np.ndarray
  v: np.ndarray
  logits: np.ndarray
  routes: np.ndarray | None = None


def batch_images(v: VisionConfig, rows: Sequence[Request | None], width: int, count: int
                 ) -> tuple[np.ndarray, vision.Images, np.ndarray]:
  """(positions i32[count, width, 3], the images, each row's first generated token's position
  i32[count]) of `rows` (requests, None for padding) left-padded to `width` in `count` rows: a
  prompt with images has its multimodal RoPE positions (models/vision.py), the others count
  from 0 on all three axes; tokens go on from a prompt's largest position + 1 (SGLang's
  mrope_position_delta). The images' patches are padded to a power of two (few shapes)."""
  positions = np.zeros((count, width, 3), np.int32)
  following = np.ones(count, np.int32)
  images, slots = [], []
  for row, r in enumerate(rows):
    if r is None:
      continue
    pad = width - len(r.input_ids)
    at = (vision.mrope_positions(r.input_ids, [im.grid for im in r.images], v) if r.images
          else np.repeat(np.arange(len(r.input_ids))[:, None], 3, axis=1))
    positions[row, pad:] = at
    following[row] = at.max() + 1
    if r.images:
      images += r.images
      slots += [row * width + pad + i for i in vision.placeholder_slots(r.input_ids, v)]
  patches = bucket(max(sum(im.patches.shape[0] for im in images), 1), 64)
  return positions, vision.batch_images(images, v, slots, patches), following


def _prefix_key(r: Request, fed: int) -> tuple:
  """What the prefix cache keeps `r`'s input and first `fed` generated tokens under: the
  tokens, then its images' digests (the same ids with other images are another prefix; SGLang
  keys image tokens by their image's hash: schedule_batch.py
  MultimodalDataItem.pad_value)."""
  return tuple(r.input_ids) + tuple(r.tokens[:fed]) + r.image_key


def _layout(r: Request) -> tuple[int, int]:
  """What fixes a row's shapes in a batch: its prompt-width bucket and max_new_tokens bucket
  (with them the prompt width, the cache's length and when it grows)."""
  return bucket(len(r.input_ids), 16), bucket(r.max_new_tokens, 16)


class Scheduler:
  """Runs waiting requests in batches on a background thread, one token per step.

  Like SGLang's radix cache, but only for whole sequences: the KV of aborted requests is
  kept (at most PREFIX_CACHE_ENTRIES, least recently stored dropped first, all dropped when
  the weights change or on /flush_cache), so that partial rollouts resumed with prompt +
  partial completion do not recompute it.

  `deterministic`: each request's output depends on it alone, not on the batch it joins (the
  module docstring says how and what it costs)."""

  def __init__(self, cfg: ModelConfig, params, *, weight_version: str = "default",
               model_path: str = "", max_batch: int = 64, deterministic: bool = False,
               memory_saver: bool = False, weights_cpu_backup: bool = False,
               return_routed_experts: bool = False):
    self.cfg, self.params = cfg, params
    self.serves_int4 = any(isinstance(leaf, quantize.Packed) and leaf.fmt == "int4" for leaf in
                           jax.tree.leaves(params, is_leaf=lambda x: isinstance(
                               x, quantize.Packed)))
    # SGLang's --enable-return-routed-experts: without it a request asking for them gets
    # none, and no error (moe.md section 4.1); a dense model has none to record.
    self.return_routed_experts = return_routed_experts
    self.records_routes = return_routed_experts and cfg.moe is not None
    self.weight_version, self.model_path = weight_version, model_path
    self.max_batch, self.deterministic = max_batch, deterministic
    self.eos_ids = checkpoint_eos_ids(model_path)  # read at start, as SGLang does
    self.lock = threading.Condition()
    self.waiting: list[Request] = []
    self.running: list[Request] = []
    # Arrived while paused or during a weight update: they wait outside the scheduler, as
    # SGLang's wait in its tokenizer manager (tokenizer_manager.py L938-942), not counted in
    # /v1/loads.
    self.held: list[Request] = []
    # Rids of /generate calls still reading their body's images: SGLang registers a rid
    # before it loads and processes the request's images (tokenizer_manager.py L926, then
    # L1202-1217), so an abort in between is spent on nothing (abort_by_rid).
    self.pending: dict[str, Pending] = {}
    self.updating = 0  # weight updates waiting for the requests in flight
    self.paused: str | None = None  # None, "in_place" or "retract" (abort unpauses nothing)
    self.stopped = False
    self.prefixes: dict[tuple, CachedPrefix] = {}  # _prefix_key -> prefix; order = age
    self.last_output = 0.0  # time.time() of the last token or finished request (/health)
    self.healthy = True  # the last /health passed (SGLang's ServerStatus.Up), for /ready
    # Memory release (release_memory): SGLang's --enable-memory-saver and
    # --enable-weights-cpu-backup, the tags released (its offload_tags), the host copy of the
    # weights (with the backup) or their shapes (without).
    self.memory_saver, self.weights_cpu_backup = memory_saver, weights_cpu_backup
    self.released: set[str] = set()
    self.stashed: Any = None
    self.crashed: str | None = None  # why the scheduler stopped (SchedulerCrash)
    self.on_crash = None  # called after a crash (main: exit the process, as SGLang's does)
    self.thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
    self.thread.start()

  # --- control, from HTTP threads

  def register(self, rids: Sequence[str]) -> list[str]:
    """Hold `rids` (a /generate body's) while the call reads its images: RequestError when
    one is alive or pending (SGLang's _init_req_state refuses it before anything else,
    tokenizer_manager.py L926, L3833-3836). Returns them, for `unregister`."""
    with self.lock:
      alive = {r.rid for r in self.waiting + self.running + self.held if not r.done.is_set()}
      for rid in rids:
        if rid in alive or rid in self.pending or rids.count(rid) > 1:
          raise RequestError(f"Duplicate request ID detected: {rid}")
      self.pending.update({rid: Pending() for rid in rids})
    return list(rids)

  def unregister(self, rids: Sequence[str]) -> None:
    with self.lock:
      for rid in rids:
        self.pending.pop(rid, None)

  def submit(self, requests: list[Request]):
    """Queue `requests`; RequestError when a rid is one still alive here (SGLang refuses it,
    tokenizer_manager.py L3833-3836) or a logprob_start_len is past the input (scheduler.py
    L3275-3280)."""
    with self.lock:
      if self.crashed:
        raise SchedulerCrash(self.crashed)
      # A finished request stays in `running` until its batch ends; SGLang forgets a rid
      # once its request is finished (tokenizer_manager.py L2774), before it answers.
      alive = {r.rid for r in self.waiting + self.running + self.held if not r.done.is_set()}
    for r in requests:
      if r.rid in alive:
        raise RequestError(f"Duplicate request ID detected: {r.rid}")
      if r.return_logprob and r.logprob_start_len > len(r.input_ids):
        raise RequestError(f"req.logprob_start_len={r.logprob_start_len} is higher than the "
                           f"number of input tokens len(req.origin_input_ids)="
                           f"{len(r.input_ids)}. Please use a smaller logprob_start_len.")
      start = r.routed_experts_start_len
      if r.return_routed_experts and start < 0:  # scheduler.py L3300-3318
        raise RequestError(f"recv_req.routed_experts_start_len={start} is lower than 0. "
                           "Please use a non-negative routed_experts_start_len.")
      if r.return_routed_experts and start > len(r.input_ids):
        raise RequestError(f"recv_req.routed_experts_start_len={start} is higher than the "
                           f"number of input tokens len(req.origin_input_ids)="
                           f"{len(r.input_ids)}. Please use a smaller "
                           "routed_experts_start_len.")
    scored = [r for r in requests if r.return_logprob and 0 <= r.logprob_start_len]
    if scored:  # a prefill of the inputs (teacher scoring: max_new_tokens 0)
      with self.lock:  # not while paused or updating, like any request
        while (self.paused or self.updating) and not self.stopped:
          self.lock.wait()
        self._check_not_released("a prefill")
        params = self.params
      # Deterministic, each alone: its shapes (and top-k or not) then depend on it only.
      for group in ([[r] for r in scored] if self.deterministic else [scored]):
        self._score(params, group)
    with self.lock:
      for r in requests:
        # An abort spent while it was pending: later ones are dropped (abort_by_rid).
        r.abort_sent = r.abort_sent or (r.rid in self.pending and self.pending[r.rid].abort_sent)
        if r.max_new_tokens == 0:
          self._finish(r, {"type": "length", "length": 0})
        else:
          (self.held if self.updating or self.paused else self.waiting).append(r)
      self.lock.notify_all()

  def _score(self, params, scored: list[Request]) -> None:
    """The input log-probs (and top-k, when asked) of `scored`, from one prefill. As SGLang's,
    they cover input_ids[logprob_start_len:], and the entry at logprob_start_len (and its
    top-k row) is null: to score token s, ask from s - 1 (logprob_result_processor.py L33-38,
    L66-81)."""
    scored = [r for r in scored if r.logprob_start_len < len(r.input_ids)]
    for r in scored:
      if r.logprob_start_len == len(r.input_ids) - 1:  # the null entry alone
        r.input_logprobs = [[None, r.input_ids[-1] if r.input_ids[-1] < self.cfg.vocab_size - 1
                             else 0]]
        r.input_top_logprobs = [None] if r.top_logprobs_num else []
    scored = [r for r in scored if r.logprob_start_len < len(r.input_ids) - 1]
    if not scored:
      return
    heads, tails = ([r.input_ids[:r.logprob_start_len + 1] for r in scored],
                    [r.input_ids[r.logprob_start_len + 1:] for r in scored])
    k = max(r.top_logprobs_num for r in scored)
    if k:  # one prefill gives both
      results = score_continuations_top_k(params, self.cfg, heads, tails, k)
    else:
      results = [(lp, None, None) for lp in score_continuations(params, self.cfg, heads,
                                                                  tails)]
    # SGLang reports an input token id >= vocab_size - 1 as 0 (logprob_result_processor.py
    # L53-56).
    shown = lambda t: t if t < self.cfg.vocab_size - 1 else 0
    for r, tail, (lp, ids, top) in zip(scored, tails, results):
      r.input_logprobs = [[None, shown(r.input_ids[r.logprob_start_len])]] + [
          [float(v), shown(t)] for v, t in zip(lp, tail)]
      if r.top_logprobs_num:
        r.input_top_logprobs = [None] + [
            [[float(v), int(t)] for v, t in zip(row_lp[:r.top_logprobs_num],
                                                row_ids[:r.top_logprobs_num])]
            for row_lp, row_ids in zip(top, ids)]

  def abort_by_rid(self, rid: str) -> None:
    """/abort_request with a rid, as SGLang's tokenizer manager passes it on
    (tokenizer_manager.py L2241-2260): an unknown or empty rid, or one aborted before, does
    nothing; the abort of a request still reading its images (pending) or held (paused,
    updating) is lost: it reaches a scheduler that does not have it yet, and the request runs
    once let through (L926-951)."""
    with self.lock:
      found = [r for r in self.held + self.waiting + self.running if r.rid == rid]
      if not found and rid in self.pending:
        found = [self.pending[rid]]
      if not rid or not found or found[0].abort_sent:
        return
      found[0].abort_sent = True
      if found[0] in self.held or isinstance(found[0], Pending):
        return
    self.abort(rid)

  def generates_within(self, timeout: float) -> bool:
    """SGLang's health check (http_server.py L721-800): a one-token greedy request of
    input_ids [0] is sent the usual way, and the server is healthy once anything (a token, a
    finished request) comes out within `timeout` s. So it blocks while paused or loading
    weights. (SGLang looks once a second; this looks as soon as something comes out.)"""
    tic = time.time()
    probe = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0], max_new_tokens=1,
                    temperature=0.0, top_p=1.0, stop_token_ids=(), seed=42,
                    return_logprob=False)
    self.submit([probe])
    with self.lock:
      while self.last_output <= tic and time.time() < tic + timeout:
        self.lock.wait(max(0.0, min(0.05, tic + timeout - time.time())))
      healthy = self.last_output > tic
    self.abort(probe.rid)  # gone from the queue if it waits there
    return healthy

  def abort(self, rid: str | None, message: str = "Aborted"):
    """Abort every queued and running request when `rid` is None, else those whose rid starts
    with it (SGLang's scheduler matches so, scheduler.py L5677-5744; its HTTP endpoint lets
    only a live rid through, Server.abort_request). Held requests (arrived while paused or
    updating) are not in the scheduler yet, as in SGLang, and are not aborted."""
    if os.environ.get("LONGRL_SERVER_DEBUG"):
      print(f"abort {rid!r} at {time.time():.3f}", file=sys.stderr)
    with self.lock:
      for r in list(self.waiting):
        if rid is None or r.rid.startswith(rid):
          self.waiting.remove(r)
          self._finish(r, {"type": "abort", "message": "Abort in waiting queue"})
      for r in self.running:
        if rid is None or r.rid.startswith(rid):
          r.aborted = message
      self.lock.notify_all()

  def pause(self, mode: str):
    if mode == "abort":
      self.abort(None)
      with self.lock:  # "abort" pauses too: nothing new starts until continue
        self.paused = "abort"
        while self.running:
          self.lock.wait(0.01)
    else:
      with self.lock:
        self.paused = mode

  def resume(self):
    with self.lock:
      self.paused = None
      self._release_held()

  def _release_held(self):
    """Requests held while paused or updating join the queue once neither is (under the
    lock)."""
    if not self.updating and not self.paused:
      self.waiting.extend(self.held)
      self.held.clear()
    self.lock.notify_all()

  def update_weights(self, params, version: str | None, model_path: str | None,
                     flush_cache: bool = True) -> bool:
    """Serve `params` from now on; False when `flush_cache` was asked and refused (not idle:
    paused in place with requests frozen mid-generation): SGLang then keeps the new weights,
    the old cache and the old version, and fails the call (weight_updater.py L120-133,
    L152-158; tokenizer_manager.py L2318-2319)."""
    with self.lock:
      # SGLang's model-update writer lock: unless paused, the update waits for the requests
      # in flight (running or queued), which finish on the old weights, and requests that
      # arrive meanwhile wait for the new ones (self.held).
      self.updating += 1
      try:
        while (self.running or self.waiting) and self.paused is None:
          self.lock.wait(0.01)
        self.params = params
        if model_path is not None:
          self.model_path = model_path
        if flush_cache and not self._idle():
          return False
        self.prefixes.clear()  # their keys and values belong to the old weights
        if version is not None:
          self.weight_version = str(version)
        return True
      finally:
        self.updating -= 1
        self._release_held()

  def drop_weights_if_paused(self) -> bool:
    """Paused with nothing running, drop the weights before an update loads the new ones:
    SGLang loads them over the old (one copy at a time), and a second copy of a 1.5B model
    is 3 GiB a server. Only when they can be read back (from model_path) if the load fails;
    True when dropped."""
    with self.lock:
      if self.paused and not self.running and self.model_path:
        self.params = None
        return True
      return False

  def flush_cache(self) -> bool:
    """Drop the cached prefixes; refused (False) unless idle, as SGLang's (scheduler.py
    L5518-5545)."""
    with self.lock:
      if not self._idle():
        return False
      self.prefixes.clear()
      return True

  def _idle(self) -> bool:
    """Under the lock: SGLang's is_fully_idle(ignore_waiting=paused in place or by retract)
    (scheduler.py L5337-5364, L5520): nothing running (a batch paused by retract waits) and,
    unless so paused, nothing waiting."""
    frozen = self.paused in ("in_place", "retract")
    return (not self.running or self.paused == "retract") and (not self.waiting or frozen)

  # --- memory release (hybrid deployment: trainer and engine take turns on the accelerator)

  def release_memory(self, tags: Sequence[str] | None) -> None:
    """SGLang's /release_memory_occupation (weight_updater.py L337-381): `tags` (none: all of
    MEMORY_TAGS) are released until resume_memory. Only when idle (nothing running, nothing
    waiting unless paused), else the scheduler asserts and the server goes down. kv_cache
    drops the cached prefixes, as SGLang flushes its cache; with memory_saver (SGLang's
    --enable-memory-saver; without it its adapter frees nothing) it frees the KV and weights
    too: weights are dropped, or moved to a host copy with weights_cpu_backup."""
    with self.lock:
      if not self._idle():
        self._crash("AssertionError: release_memory_occupation should be called only when "
                    "server is idle.")
      tags = list(tags or MEMORY_TAGS)
      self.released.update(tags)
      if "kv_cache" in tags:
        self.prefixes.clear()
      if "weights" in tags and self.memory_saver and self.params is not None:
        self.stashed = (jax.device_get(self.params) if self.weights_cpu_backup else
                        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                     self.params))
        self.params = None  # freed with its last reference (main keeps none; serve's caller may)
      if self.memory_saver:  # the heap keeps what XLA:CPU freed: give it back now
        host_allocator.return_freed_memory()

  def resume_memory(self, tags: Sequence[str] | None) -> None:
    """SGLang's /resume_memory_occupation (weight_updater.py L383-422): `tags` (none: all)
    are taken back. A tag not released takes the server down (a KeyError in its scheduler,
    L389-390). Weights come back as they were with weights_cpu_backup; without it their
    contents are undefined on SGLang (fresh GPU pages) until the next update, and zeros
    here."""
    with self.lock:
      tags = list(tags or MEMORY_TAGS)
      for tag in tags:
        if tag not in self.released:
          self._crash(f"KeyError: {tag!r}")
        self.released.discard(tag)
      if "weights" in tags and self.stashed is not None:
        self.params = (jax.device_put(self.stashed) if self.weights_cpu_backup else
                       jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self.stashed))
        self.stashed = None

  def _check_not_released(self, what: str, tags: Sequence[str] = ("weights", "kv_cache")
                          ) -> None:
    """Under the lock: SGLang's kernels would touch released GPU memory (an illegal memory
    access takes the server down), so `what` while any of `tags` is released crashes."""
    if self.memory_saver and self.released & set(tags):
      self._crash(f"RuntimeError: {what} on released memory "
                  f"({', '.join(sorted(self.released))}): resume_memory_occupation first")

  def _crash(self, error: str):
    """Under the lock: stop as SGLang's scheduler does on an exception (scheduler.py
    L6370-6380: it logs it and the whole server exits), failing every request here."""
    print(f"rollouts.server: Scheduler hit an exception: {error}", file=sys.stderr, flush=True)
    self.crashed, self.stopped = error, True
    for r in self.held + self.waiting + self.running:
      if not r.done.is_set():
        self._finish(r, {"type": "abort", "message": f"server down: {error}",
                         "status_code": 500, "err_type": "SchedulerCrash"})
    self.lock.notify_all()
    if self.on_crash is not None:
      self.on_crash()
    raise SchedulerCrash(error)

  def loads(self) -> dict:
    with self.lock:
      return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
              "num_used_tokens": sum(len(r.input_ids) + len(r.tokens) for r in self.running)}

  def warmup(self, max_len: int):
    """Compile the prefill and decode steps of every batch shape for up to max_batch requests
    of up to `max_len` tokens each (prompt + new), before serving; SGLang captures its CUDA
    graphs at start-up for the same reason: a shape first met while serving stalls every
    request in the batch for the compile (seconds on a CPU). Runs real batches of dummy
    requests through the scheduler's own path."""
    widths = bucket(max_len, 16)
    for rows in sorted({self._rows(n) for n in range(1, self.max_batch + 1)}):
      dummy = lambda length, new: [Request(
          rid=f"warmup-{i}", input_ids=[0] * length, max_new_tokens=new, temperature=1.0,
          top_p=1.0, stop_token_ids=(), seed=i, return_logprob=False) for i in range(rows)]
      width = 16
      while width <= widths:  # every prefill width, with one decode step
        self._run(dummy(width, 1))
        width *= 2
      # Decode steps at every cache length: a cache grows at most until it holds the
      # longest prompt's width plus as many new tokens.
      self._run(dummy(16, 2 * widths - 16))

  # --- the loop

  def _finish(self, r: Request, reason: dict):
    r.finish_reason = reason
    if r.return_routed_experts and r.routes:
      r.routed_experts = self._routed_experts(r)
    self.last_output = time.time()
    r.done.set()

  def _routed_experts(self, r: Request) -> str:
    """meta_info.routed_experts of a finished request, as SGLang encodes it: the base64 of
    int32 [rows, num_layers, k] bytes, row j the experts of input token start_len + j (the
    prompt's and the generated ones' but the last, which was never fed: rows = prompt +
    completion - 1 - start_len), every decoder layer's, a dense layer's 0
    (batch_result_processor.py L136-180, tokenizer_manager.py L2602-2609, moe.md 4.2-4.3)."""
    rows = np.stack(r.routes)[:len(r.input_ids) + len(r.tokens) - 1][r.routed_experts_start_len:]
    full = np.zeros((len(rows), self.cfg.num_layers, rows.shape[-1]), "<i4")
    full[:, list(self.cfg.sparse_layers)] = rows
    return base64.b64encode(full.tobytes()).decode("ascii")

  def _loop(self):
    try:
      self._serve_batches()
    except SchedulerCrash:  # self.crashed says why; every request was failed
      return

  def _serve_batches(self):
    while True:
      with self.lock:
        while not self.stopped and (not self.waiting or self.paused):
          self.lock.wait()
        if self.stopped:
          return
        # A client fans a group out as separate requests: wait until they stop arriving
        # (GATHER_SECONDS without a new one) so that they share a batch.
        while len(self.waiting) < self.max_batch:
          count = len(self.waiting)
          self.lock.wait(GATHER_SECONDS)
          if len(self.waiting) == count:
            break
        self._check_not_released("a batch")
        batch = self._next_batch()
        if os.environ.get("LONGRL_SERVER_DEBUG"):
          print(f"batch of {len(batch)}, {len(self.waiting)} waiting at {time.time():.3f}, "
                f"first arrived {min(r.started for r in batch):.3f}", file=sys.stderr)
        self.running = batch
      try:
        started = time.perf_counter()
        steps = self._run(batch)
        if os.environ.get("LONGRL_SERVER_DEBUG"):
          print(f"  {steps} steps in {time.perf_counter() - started:.3f} s, done at "
                f"{time.time():.3f}", file=sys.stderr)
      except Exception as e:  # never leave a client waiting forever
        for r in batch:
          if not r.done.is_set():
            self._finish(r, {"type": "abort", "message": f"server error: {e}",
                             "status_code": 500, "err_type": type(e).__name__})
      with self.lock:
        self.running = []
        self.lock.notify_all()

  def _next_batch(self) -> list[Request]:
    """The next batch, out of the waiting queue (call under the lock): its first max_batch
    requests; deterministic, the first max_batch of those laid out as the oldest one is."""
    if not self.deterministic:
      batch, self.waiting = self.waiting[:self.max_batch], self.waiting[self.max_batch:]
      return batch
    layout = _layout(self.waiting[0])
    batch = [r for r in self.waiting if _layout(r) == layout][:self.max_batch]
    taken = {id(r) for r in batch}
    self.waiting = [r for r in self.waiting if id(r) not in taken]
    return batch

  def _rows(self, requests: int) -> int:
    """The rows of a batch of `requests`: fixed when deterministic (a matmul's kernel, and
    with it a row's sums, may change with the row count)."""
    return self.max_batch if self.deterministic else shape_bucket(requests, 8)

  def _batch_arrays(self, batch: list[Request], rows: int, plen: int, size: int):
    """The batch's prompts left-padded into i32[rows, plen], their lengths i32[rows], the
    cache's validity bool[rows, size], the prompts' positions (i32[rows, plen], or [rows,
    plen, 3] and their images when some prompt has images: batch_images) and each row's
    first generated token's position i32[rows]."""
    prompts = np.zeros((rows, plen), np.int32)
    lens = np.ones(rows, np.int32)
    for i, r in enumerate(batch):
      prompts[i, plen - len(r.input_ids):] = r.input_ids
      lens[i] = len(r.input_ids)
    slots = np.arange(plen)
    kv_valid = np.zeros((rows, size), bool)
    kv_valid[:, :plen] = slots[None, :] >= (plen - lens)[:, None]
    if not any(r.images for r in batch):
      return (prompts, lens, kv_valid, np.maximum(slots[None, :] - (plen - lens)[:, None], 0),
              None, lens)
    positions, images, following = batch_images(self.cfg.vision, batch, plen, rows)
    return prompts, lens, kv_valid, positions, images, following

  def _run(self, batch: list[Request]):
    rows = self._rows(len(batch))
    plen = bucket(max(len(r.input_ids) for r in batch), 16)
    max_new = bucket(max(r.max_new_tokens for r in batch), 16)
    # The cache starts with room for 32 new tokens and grows to the next bucket when full:
    # decode attention spans the whole cache, and most batches (aborted, or short answers)
    # end early.
    size = shape_bucket(plen + min(max_new, 32), 64)
    prompts, lens, kv_valid, positions, images, following = self._batch_arrays(
        batch, rows, plen, size)
    with self.lock:
      params = self.params
      cached = {} if self.deterministic else {
          i: self._cached_prefix(_prefix_key(r, 0)) for i, r in enumerate(batch)}
    cached = {i: c for i, c in cached.items() if c is not None}
    for i in cached:
      batch[i].cached_tokens = len(batch[i].input_ids)
    t0 = time.perf_counter()
    logits, cache, routes = self._prefill_missing(params, prompts, positions, kv_valid, lens,
                                                  cached, size, (batch, images))
    if self.records_routes:
      routes = np.asarray(routes)
      for i, r in enumerate(batch):
        r.routes = list(routes[i, plen - lens[i]:])
    if os.environ.get("LONGRL_SERVER_DEBUG"):
      jax.block_until_ready(logits)
      print(f"  prefill of {rows} rows x {plen} ({len(cached)} cached) in "
            f"{time.perf_counter() - t0:.3f} s", file=sys.stderr)
    kv_valid = jnp.asarray(kv_valid)
    stopped_at: dict[int, tuple[int, np.ndarray]] = {}  # aborted row -> (tokens fed, logits)
    temperature = np.ones(rows, np.float32)
    top_p = np.ones(rows, np.float32)
    seeds = np.zeros(rows, np.uint32)
    for i, r in enumerate(batch):
      temperature[i], top_p[i], seeds[i] = r.temperature, r.top_p, r.seed
    keys = _request_keys(jnp.asarray(seeds))
    temperature, top_p = jnp.asarray(temperature), jnp.asarray(top_p)
    active = np.zeros(rows, bool)
    active[:len(batch)] = True
    for i in range(max_new):
      with self.lock:
        while self.paused in ("in_place", "retract") and not any(r.aborted for r in batch):
          self.lock.wait(0.05)  # frozen: the KV stays, weights may change meanwhile
        params, version = self.params, self.weight_version
        aborted = [row for row, r in enumerate(batch) if active[row] and r.aborted]
        if aborted:  # one copy to the host, not a slicing op compiled per batch shape
          host_logits = np.asarray(logits)
        for row in aborted:
          active[row] = False
          stopped_at[row] = (i, host_logits[row].copy())
          self._finish(batch[row], {"type": "abort", "message": batch[row].aborted,
                                    "status_code": None, "err_type": None})
      if not active.any():
        self._keep_prefixes(batch, stopped_at, cache, plen, lens, version)
        return i
      if plen + i == size:
        grown = shape_bucket(size + 1, 64)
        cache, kv_valid = _grow(cache, kv_valid, grown - size)
        size = grown
      token, logp, logits, cache, kv_valid, routes = _step(
          params, logits, cache, kv_valid, keys, temperature, top_p,
          jnp.asarray(following + i), plen + i, jnp.asarray(active), i, cfg=self.cfg)
      self._take(batch, active, np.asarray(token), np.asarray(logp), version,
                 np.asarray(routes) if self.records_routes else None)
    self._keep_prefixes(batch, stopped_at, cache, plen, lens, version)
    return max_new

  def _take(self, batch: list[Request], active: np.ndarray, token: np.ndarray,
            logp: np.ndarray, version: int, routes: np.ndarray | None) -> None:
    """One decode step's tokens (and, recorded, the experts they were fed to) into the active
    requests (`active` updated in place); those that stop or reach their length finish."""
    with self.lock:
      for row, r in enumerate(batch):
        if not active[row]:
          continue
        r.tokens.append(int(token[row]))
        if routes is not None:
          r.routes.append(routes[row])
        self.last_output = time.time()
        r.logprobs.append(float(logp[row]))
        r.versions.append(version)
        if token[row] in r.stop_token_ids:
          active[row] = False
          self._finish(r, {"type": "stop", "matched": int(token[row])})
        elif len(r.tokens) >= r.max_new_tokens:
          active[row] = False
          self._finish(r, {"type": "length", "length": r.max_new_tokens})
      self.lock.notify_all()

  def _prefill_missing(self, params, prompts, positions, kv_valid, lens, cached, size,
                       inputs: tuple[list[Request], vision.Images | None]):
    """(logits f32[rows, vocab], KVCache of `size` slots, a mixture's experts of the prompt
    tokens i32[rows, plen, sparse layers, k] or None) for the batch: prefill for the rows
    without a cached prefix (all rows when none has one), the cached keys, values, logits
    and routes placed for the others, left-padded like a prefill would. `inputs`: the
    batch's requests and their images (None: none has any)."""
    rows, plen = prompts.shape
    batch, images = inputs
    missing = [i for i in range(rows) if i not in cached]
    if not cached:  # prefilled at the prompts' width, whatever the cache's: fewer shapes
      logits, cache, routes = _prefill(params, jnp.asarray(prompts), jnp.asarray(positions),
                                       jnp.asarray(kv_valid[:, :plen]),
                                       transformer.init_cache(self.cfg, rows, plen), images,
                                       cfg=self.cfg)
      return logits, _grow(cache, kv_valid[:, :plen], size - plen)[0], routes
    logits = np.zeros((rows, self.cfg.vocab_size), np.float32)
    k = np.zeros((self.cfg.num_layers, rows, self.cfg.num_kv_heads, size,
                  self.cfg.head_dim), np.dtype(self.cfg.compute_dtype))
    v = np.zeros_like(k)
    routes = None
    if self.records_routes:
      routes = np.zeros((rows, plen, len(self.cfg.sparse_layers),
                         self.cfg.moe.experts_per_token), np.int32)
    if missing:
      # Only as wide as the longest missing prompt (fresh prompts are short, resumed ones
      # long): its columns are the last `width` of the batch's left-padded layout.
      width = bucket(max(int(lens[i]) for i in missing), 16)
      # As many rows as the batch (repeats of a missing one): the shapes a full prefill has,
      # already compiled, instead of a new one for every count of missing rows.
      pick = np.array(missing + [missing[0]] * (rows - len(missing)))
      cols = slice(plen - width, plen)
      if images is not None:  # the picked rows' images, at their places in this layout
        images = batch_images(self.cfg.vision, [batch[i] if i < len(batch) else None
                                                for i in pick], width, rows)[1]
      part_logits, part, part_routes = _prefill(params, jnp.asarray(prompts[pick, cols]),
                                   jnp.asarray(positions[pick, cols]),
                                   jnp.asarray(kv_valid[pick, cols]),
                                   transformer.init_cache(self.cfg, rows, width), images,
                                   cfg=self.cfg)
      n = len(missing)
      logits[missing] = np.asarray(part_logits)[:n]
      k[:, missing, :, cols] = np.stack(part.k)[:, :n]
      v[:, missing, :, cols] = np.stack(part.v)[:, :n]
      if routes is not None:
        routes[missing, cols] = np.asarray(part_routes)[:n]
    for i, c in cached.items():
      k[:, i, :, plen - lens[i]:plen], v[:, i, :, plen - lens[i]:plen] = c.k, c.v
      logits[i] = c.logits
      if routes is not None:
        routes[i, plen - lens[i]:plen] = c.routes
    return jnp.asarray(logits), transformer.KVCache(tuple(map(jnp.asarray, k)),
                                                    tuple(map(jnp.asarray, v))), routes

  def _cached_prefix(self, key: tuple) -> CachedPrefix | None:
    """The cached prefix of exactly `key` (_prefix_key), made the most recent; call under the
    lock."""
    found = self.prefixes.pop(key, None)
    if found is not None:
      self.prefixes[key] = found
    return found

  def _keep_prefixes(self, batch, stopped_at, cache, plen, lens, version):
    """Store the keys, values and next-token logits of the batch's aborted requests (not
    when deterministic: a resumed request then computes them as a fresh one would)."""
    if not stopped_at or self.deterministic:
      return
    k, v = np.stack(cache.k), np.stack(cache.v)
    with self.lock:
      if version != self.weight_version:
        return  # the weights changed under the batch
      for row, (fed, logits) in stopped_at.items():
        r = batch[row]
        span = slice(plen - lens[row], plen + fed)
        self.prefixes[_prefix_key(r, fed)] = CachedPrefix(
            k[:, row, :, span].copy(), v[:, row, :, span].copy(), logits,
            np.stack(r.routes[:lens[row] + fed]) if self.records_routes else None)
      while len(self.prefixes) > PREFIX_CACHE_ENTRIES:
        self.prefixes.pop(next(iter(self.prefixes)))


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


class Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: "Server"

  def log_message(self, *args):  # quiet: a trainer makes thousands of calls
    pass

  def setup(self):
    super().setup()
    # Headers and body go out in separate writes: without this, Nagle's algorithm and the
    # client's delayed ACK add ~40 ms to every call.
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

  def _body(self) -> dict:
    if not self._raw:
      return {}
    try:
      body = json.loads(self._raw)
    except json.JSONDecodeError as e:
      raise BadRequest(f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object")
    return body

  def _send(self, status: int, value: Any = None, *, text: str | None = None):
    payload = (text if text is not None else json.dumps(value) if value is not None
               else "").encode()
    self.send_response(status)
    self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
    self.send_header("Content-Length", str(len(payload)))
    self.end_headers()
    self.wfile.write(payload)

  def do_GET(self):
    self._dispatch("GET")

  def do_POST(self):
    self._dispatch("POST")

  def do_PUT(self):
    self._dispatch("POST")

  def _dispatch(self, method: str):
    # Read the whole body first, used or not: leftover bytes would corrupt the next request
    # on this keep-alive connection.
    self._raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    path = self.path.split("?", 1)[0]
    routes = self.server.routes(method)
    if path not in routes:
      self._send(404, {"detail": "Not Found"})
      return
    if self.server.refuses(path, self.headers.get("Authorization")):
      self._send(401, {"error": "Unauthorized"})
      return
    try:
      routes[path](self)
    except BadRequest as e:
      self._send(400, {"error": str(e)})
    except RequestError as e:
      self._send(400, {"error": {"message": str(e)}})
    except InternalError as e:  # Starlette's answer to an exception nobody caught
      print(f"rollouts.server: {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
      self._send(500, text="Internal Server Error")
    except SchedulerCrash as e:  # SGLang's process is gone: its connections close unanswered
      self._send(500, {"error": {"message": f"server down: {e}"}})
    except (BrokenPipeError, ConnectionResetError):
      pass


class Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 1024  # a trainer opens hundreds of connections at once; the default
  # backlog of 5 drops their SYNs and each retry costs a second

  def __init__(self, address, scheduler: Scheduler, *, served_model_name: str = "longrl",
               context_length: int = 32768, api_key: str | None = None,
               admin_api_key: str | None = None):
    super().__init__(address, Handler)
    self.scheduler = scheduler
    self.served_model_name = served_model_name
    self.context_length = context_length
    self.api_key, self.admin_api_key = api_key, admin_api_key

  def refuses(self, path: str, authorization: str | None) -> int | None:
    """401 when the call lacks the key SGLang asks of it, else None (srt/utils/auth.py
    decide_request_auth): /health and /ready need none; the control calls (ADMIN_CALLS, and
    /update_weight_version: ADMIN_OPTIONAL in http_server.py) the admin key when the server
    has one, else the API key when it has one; the rest the API key when it has one."""
    if path.startswith(("/health", "/ready")):
      return None
    admin = path in sglang.ADMIN_CALLS or path == "/update_weight_version"
    key = (self.admin_api_key or self.api_key) if admin else self.api_key
    if not key:
      return None
    scheme, _, token = (authorization or "").partition(" ")
    given = token if scheme.lower() == "bearer" else ""
    return None if hmac.compare_digest(given.encode(), key.encode()) else 401

  def handle_error(self, request, client_address):
    """A client that went away (a router's health check that timed out while /health waited
    on a pause, a killed trainer) is no error here; anything else is one line on stderr
    (which is the trainer's log), not a traceback."""
    error = sys.exc_info()[1]
    if not isinstance(error, (ConnectionError, TimeoutError)):
      print(f"rollouts.server: a request from {client_address[0]}:{client_address[1]} failed: "
            f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)

  def routes(self, method: str):
    get = {"/health": self.health, "/health_generate": self.health, "/ready": self.ready,
           "/model_info": self.model_info, "/get_model_info": self.model_info,
           "/server_info": self.server_info, "/get_server_info": self.server_info,
           "/v1/loads": self.v1_loads, "/flush_cache": self.flush_cache}
    post = {"/generate": self.generate, "/abort_request": self.abort_request,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weight_version": self.update_weight_version,
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": self.release_memory_occupation,
            "/resume_memory_occupation": self.resume_memory_occupation}
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
      get[path] = post[path]  # GET or POST, as SGLang's (http_server.py L1575-1595)
    return get if method == "GET" else post

  def health(self, h: Handler):
    """/health and /health_generate generate a token first (Scheduler.generates_within), as
    SGLang's do, within SGLANG_HEALTH_CHECK_TIMEOUT s (20); /health answers at once with
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (environ.py L344)."""
    s = self.scheduler
    if s.crashed or not s.thread.is_alive():
      h._send(503, text="")
      return
    if h.path.split("?", 1)[0] == "/health" and os.environ.get(
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("0", "false", "no",
                                                                        "n"):
      h._send(200, text="")
      return
    timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
    # A failed check marks the server unhealthy, and a passing one healthy again
    # (http_server.py L784, L798): /ready answers 503 in between.
    s.healthy = s.generates_within(timeout)
    h._send(200 if s.healthy else 503, text="")

  def ready(self, h: Handler):
    """503 while paused, or since a failed health check until one passes, as SGLang's
    is_ready (tokenizer_manager.py L728-734)."""
    ok = (self.scheduler.thread.is_alive() and not self.scheduler.crashed
          and not self.scheduler.paused and self.scheduler.healthy)
    h._send(200 if ok else 503, text="")

  def model_info(self, h: Handler):
    s = self.scheduler
    h._send(200, {"model_path": s.model_path, "served_model_name": self.served_model_name,
                  "tokenizer_path": s.model_path, "is_generation": True,
                  "preferred_sampling_params": None, "weight_version": s.weight_version,
                  "load_format": None, "reasoning_parser": None, "tool_call_parser": None})

  def server_info(self, h: Handler):
    s = self.scheduler
    h._send(200, {"model_path": s.model_path, "max_running_requests": s.max_batch,
                  "skip_tokenizer_init": True, "weight_version": s.weight_version,
                  "enable_deterministic_inference": s.deterministic, "dtype": s.cfg.dtype,
                  "enable_memory_saver": s.memory_saver,
                  "enable_weights_cpu_backup": s.weights_cpu_backup,
                  "enable_return_routed_experts": s.return_routed_experts,
                  "context_length": self.context_length,
                  "internal_states": [s.loads()], "version": "0.5.23 (longrl embedded)"})

  def v1_loads(self, h: Handler):
    h._send(200, {"timestamp": time.time(), "dp_rank_count": 1,
                  "loads": [{"dp_rank": 0, **self.scheduler.loads()}]})

  def flush_cache(self, h: Handler):
    if not self.scheduler.flush_cache():
      h._send(400, text="Cache not flushed: requests are running or queued.")
    else:
      h._send(200, text="Cache flushed.\nPlease check backend logs for more details.")

  def generate(self, h: Handler):
    """The rids first (Scheduler.register), then the images and the length checks, then the
    queue, in SGLang's order (tokenizer_manager.py generate_request)."""
    body = h._body()
    rids = self.scheduler.register(body_rids(body))
    try:
      requests, as_list = expand_request(body, self.scheduler.deterministic,
                                         self.scheduler.eos_ids, self.scheduler.cfg.vision)
      for r in requests:
        error = context_error(r, self.context_length)
        if error:
          raise RequestError(error)
      self.scheduler.submit(requests)
    finally:
      self.scheduler.unregister(rids)
    if body.get("stream"):
      self._stream(h, requests, as_list)
      return
    for r in requests:
      r.done.wait()
    errors = [r.finish_reason for r in requests if r.finish_reason["type"] == "abort"
              and (r.finish_reason.get("status_code") or 0) >= 400]
    if errors:
      h._send(errors[0]["status_code"], {"error": {"message": errors[0]["message"]}})
      return
    outputs = [response(r, self.scheduler.weight_version) for r in requests]
    h._send(200, outputs if as_list else outputs[0])

  def _stream(self, h: Handler, requests: list[Request], as_list: bool):
    """Server-sent events with cumulative chunks, then [DONE] (SGLang's default)."""
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.send_header("Connection", "close")
    h.end_headers()
    h.close_connection = True
    sent = [-1] * len(requests)
    while True:
      finished = all(r.done.is_set() for r in requests)
      for i, r in enumerate(requests):
        if len(r.tokens) != sent[i] or (r.done.is_set() and sent[i] != -2):
          chunk = response(r, self.scheduler.weight_version)
          if as_list:
            chunk["index"] = i
          h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
          sent[i] = -2 if r.done.is_set() else len(r.tokens)
      h.wfile.flush()
      if finished:
        break
      time.sleep(0.01)
    h.wfile.write(b"data: [DONE]\n\n")
    h.wfile.flush()

  def abort_request(self, h: Handler):
    """abort_all, or the rid of a live request (Scheduler.abort_by_rid): a bare prefix aborts
    nothing. (A live rid also aborts the requests whose rids it begins, as SGLang's scheduler
    does.)"""
    body = h._body()
    if body.get("abort_all"):
      self.scheduler.abort(None)
    else:
      self.scheduler.abort_by_rid(str(body.get("rid") or ""))
    h._send(200, text="")

  def pause_generation(self, h: Handler):
    mode = h._body().get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
      raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
    self.scheduler.pause(mode)
    h._send(200, {"message": "Generation paused successfully.", "status": "ok"})

  def continue_generation(self, h: Handler):
    self.scheduler.resume()
    h._send(200, {"message": "Generation continued successfully.", "status": "ok"})

  def update_weights_from_disk(self, h: Handler):
    body = h._body()
    path = body.get("model_path")
    if not isinstance(path, str):
      raise BadRequest("model_path (a checkpoint directory) is required")
    s = self.scheduler
    with s.lock:  # loading into released weights: SGLang writes into unmapped memory
      s._check_not_released("a weight update", ("weights",))
      if s.serves_int4:  # SGLang cannot load into its repacked INT4 layers: it goes down
        s._crash("AttributeError: 'Parameter' object has no attribute 'weight_loader' (an "
                 "INT4 model refit from disk, which takes SGLang 0.5.23 down: "
                 "rollouts/sglang.py refusals has its lines)")
    if body.get("abort_all_requests"):  # first, as SGLang (tokenizer_manager.py L2299-2300)
      s.abort(None)
    dropped = s.drop_weights_if_paused()
    try:
      _, params = hf.load(path, s.cfg, packed=True)
    except (hf.CheckpointError, FileNotFoundError, OSError, ValueError) as e:
      if dropped:  # back to the weights it had
        s.params = hf.load(s.model_path, s.cfg, packed=True)[1]
      h._send(400, {"success": False, "message": f"Failed to update weights: {e}",
                    "num_paused_requests": 0})
      return
    flushed = s.update_weights(params, body.get("weight_version"), path,
                               body.get("flush_cache", True) is not False)
    del params
    if s.memory_saver:  # the load's buffers, and the old weights, back to the kernel
      host_allocator.return_freed_memory()
    if not flushed:
      h._send(400, {"success": False, "num_paused_requests": 0, "message": (
          "Weights were updated, but the cache was not flushed because requests are still "
          "running or queued. Retract or finish them, then call /flush_cache.")})
      return
    h._send(200, {"success": True, "message": "Succeeded to update model weights.",
                  "num_paused_requests": 0})

  def release_memory_occupation(self, h: Handler):
    """{"tags": [...]} or none (all): Scheduler.release_memory. Answers null, as SGLang's
    (http_server.py L1575-1584)."""
    self.scheduler.release_memory(_memory_tags(h._body()))
    h._send(200, text="null")

  def resume_memory_occupation(self, h: Handler):
    """{"tags": [...]} or none (all): Scheduler.resume_memory (http_server.py L1587-1595)."""
    self.scheduler.resume_memory(_memory_tags(h._body()))
    h._send(200, text="null")

  def update_weight_version(self, h: Handler):
    body = h._body()
    if body.get("abort_all_requests", True):
      self.scheduler.abort(None)
    with self.scheduler.lock:
      self.scheduler.weight_version = str(body.get("new_version"))
    h._send(200, {"success": True, "message": "Weight version updated.",
                  "new_version": self.scheduler.weight_version})


def _memory_tags(body: dict) -> list[str] | None:
  """The `tags` of a release or resume body (ReleaseMemoryOccupationReqInput, io_struct.py
  L2177-2190): a list of strings, or none."""
  tags = body.get("tags")
  if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
    raise BadRequest(f"tags must be a list of strings (of {', '.join(MEMORY_TAGS)}), got "
                     f"{tags!r}")
  return tags


def serve(cfg: ModelConfig, params, *, host: str = "127.0.0.1", port: int = 0,
          warmup_len: int = 0, context_length: int | None = None, api_key: str | None = None,
          admin_api_key: str | None = None, **scheduler_options) -> Server:
  """A running server (on a background thread); `server.server_address` has the port.
  With warmup_len > 0, every batch shape for requests of up to that many tokens is compiled
  first (Scheduler.warmup). `context_length`: requests above it are refused as SGLang
  refuses them (context_error; default as SGLang derives it from the config.json the model
  has or would export: derived_context_length). `api_key`, `admin_api_key`: SGLang's
  --api-key and --admin-api-key (Server.refuses). `scheduler_options`: Scheduler's
  (weight_version, model_path, max_batch, deterministic, memory_saver and
  weights_cpu_backup for its release_memory, return_routed_experts: a mixture's routes are
  recorded for requests that ask)."""
  scheduler = Scheduler(cfg, params, **scheduler_options)
  if warmup_len > 0:
    scheduler.warmup(warmup_len)
  if context_length is None:
    context_length = derived_context_length(hf.config_to_hf(cfg))
    if scheduler.model_path:
      with open(os.path.join(scheduler.model_path, "config.json")) as f:
        context_length = derived_context_length(json.load(f))
  server = Server((host, port), scheduler, context_length=context_length, api_key=api_key,
                  admin_api_key=admin_api_key)
  threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
  return server


def served_dtype(config: dict, dtype: str) -> str:
  """The dtype a server started with `--dtype dtype` computes and holds weights in, by
  SGLang's rule (configs/model_config.py L2284-2324): 'auto' is config.json's dtype
  (torch_dtype), and float32 (or none) becomes float16 (bfloat16 for Gemma). A float32
  export served with --dtype auto computes in float16."""
  if dtype != "auto":
    return dtype
  found = config.get("dtype") or config.get("torch_dtype") or "float32"
  if found not in ("float32", "float"):
    return found
  return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


def load_model(*, model=None, hf_checkpoint: str | None = None, seed: int = 0,
               dtype: str = "auto") -> tuple[ModelConfig, Any, str]:
  """(cfg, params, model_path) to serve: a Hugging Face checkpoint directory, in `dtype`
  (served_dtype; a quantized one's projections held as stored, dequantized on the fly, as
  SGLang serves it), or `model` (a config factory such as models.config.tiny, called with the
  character tokenizer's vocabulary) with random weights from `seed`, in its own dtype unless
  `dtype` names one."""
  if hf_checkpoint:
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
      held = served_dtype(json.load(f), dtype)
    cfg, params = hf.load(hf_checkpoint, dtype=held, param_dtype=held, packed=True)
    return cfg, params, hf_checkpoint
  if model is None:
    raise ValueError("load_model: give hf_checkpoint or model")
  from models.tokenizer import CharTokenizer
  cfg = model(CharTokenizer().vocab_size)
  if dtype != "auto":
    cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
  return cfg, transformer.init_params(cfg, jax.random.PRNGKey(seed)), ""


def _parser() -> argparse.ArgumentParser:
  """The command line of `main` (the module docstring has its synopsis)."""
  parser = argparse.ArgumentParser(description="Serve the embedded JAX engine over SGLang's "
                                   "HTTP protocol.")
  parser.add_argument("--hf_checkpoint", help="a Hugging Face checkpoint directory to serve")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
  parser.add_argument("--weight_version", default="default")
  parser.add_argument("--max_batch", type=int, default=64)
  parser.add_argument("--warmup_len", type=int, default=0, metavar="TOKENS",
                      help="before serving, compile every batch shape for requests of up to "
                      "TOKENS tokens (prompt + new); 0: compile shapes as they come")
  parser.add_argument("--dtype", default="auto",
                      choices=("auto", "float32", "bfloat16", "float16", "half", "float"),
                      help="what the weights are held and computed in; auto: config.json's "
                      "dtype, float32 becoming float16 (SGLang's --dtype, served_dtype)")
  parser.add_argument("--deterministic", "--enable-deterministic-inference",
                      action="store_true",
                      default=os.environ.get(sglang.DETERMINISTIC_ENV) == "1",
                      help="each request's output depends on it alone, not on its batch, "
                      "and sampling_seed is honoured (SGLang's --enable-deterministic-"
                      f"inference; default: on when {sglang.DETERMINISTIC_ENV}=1)")
  parser.add_argument("--enable-memory-saver", "--enable_memory_saver", action="store_true",
                      help="/release_memory_occupation frees the weights and KV cache "
                      "(SGLang's flag; without it a release only flushes the cache)")
  parser.add_argument("--enable-weights-cpu-backup", "--enable_weights_cpu_backup",
                      action="store_true", help="released weights are kept in host memory "
                      "and come back on resume (without: undefined until an update)")
  parser.add_argument("--enable-return-routed-experts", "--enable_return_routed_experts",
                      action="store_true", help="a mixture's experts of every token are "
                      "recorded and returned to requests with return_routed_experts "
                      "(SGLang's flag; without it they get none)")
  parser.add_argument("--context-length", "--context_length", type=int, default=None,
                      help="the most tokens (input + max_new_tokens) a request may hold; "
                      "longer ones are refused with SGLang's 400 (default: config.json's, "
                      "as SGLang derives it)")
  parser.add_argument("--api-key", "--api_key", default=None,
                      help="SGLang's --api-key: every call but /health and /ready needs it")
  parser.add_argument("--admin-api-key", "--admin_api_key", default=None,
                      help="SGLang's --admin-api-key: the control calls need it (and no "
                      "longer take the API key)")
  parser.add_argument("--exit_with_parent", action="store_true",
                      help="stop when the process that started this one exits (launch sets it)")
  return parser


def main(argv=None, *, load=None):
  """Serve until interrupted. `load() -> (cfg, params, model_path)` gives the model when the
  caller built it (experiments/serve.py: from gin); else --hf_checkpoint does."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.exit_with_parent:
    parent = os.getppid()

    def watch():
      while os.getppid() == parent:
        time.sleep(1.0)
      os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
  dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
  if args.hf_checkpoint:
    cfg, params, path = load_model(hf_checkpoint=args.hf_checkpoint, dtype=dtype)
  elif load is not None:
    cfg, params, path = load(dtype=dtype)
  else:
    parser.error("give --hf_checkpoint DIR (a model bound in gin: python -m experiments.serve "
                 "--gin FILE)")
  # The scheduler thread holds the GIL between decode steps; hand it over sooner so that the
  # HTTP threads answer finished and aborted requests within a step or two, not ~5 ms each.
  sys.setswitchinterval(0.0005)
  server = serve(cfg, params, host=args.host, port=args.port,
                 weight_version=args.weight_version, model_path=path, max_batch=args.max_batch,
                 warmup_len=args.warmup_len, deterministic=args.deterministic,
                 memory_saver=args.enable_memory_saver,
                 weights_cpu_backup=args.enable_weights_cpu_backup,
                 return_routed_experts=args.enable_return_routed_experts,
                 context_length=args.context_length, api_key=args.api_key,
                 admin_api_key=args.admin_api_key)
  server.scheduler.on_crash = lambda: os._exit(1)  # as SGLang's server goes down
  del params  # the scheduler's is then the only reference: a release frees the weights
  host, port = server.server_address[:2]
  print(f"listening on http://{host}:{port}", flush=True)
  try:
    threading.Event().wait()
  except KeyboardInterrupt:
    pass


def launch(args: list[str], *, timeout: float = 300.0, env: dict | None = None,
           module: str = "rollouts.server", cores: Sequence[int] = ()
           ) -> tuple[subprocess.Popen, str]:
  """Start `python -m MODULE ARGS` (this server, or experiments.serve for a gin-bound model)
  and return (process, base URL) once it accepts connections; its stderr goes to ours.
  `cores`: the CPU cores it runs on (taskset; default: ours)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
  process = subprocess.Popen([*pin, sys.executable, "-m", module, *args,
                              "--exit_with_parent"], cwd=root, stdout=subprocess.PIPE,
                             text=True, env=env)
  deadline = time.monotonic() + timeout
  url = None
  while url is None:
    line = process.stdout.readline()
    if not line:
      raise RuntimeError(f"rollouts.server exited with code {process.wait()} before serving "
                         f"(args {args})")
    if line.startswith("listening on "):
      url = line.split()[-1]
    if time.monotonic() > deadline:
      process.kill()
      raise TimeoutError(f"rollouts.server did not start within {timeout} s")
  host, port = url.split("//")[1].split(":")
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1):
        return process, url
    except OSError:
      if time.monotonic() > deadline:
        process.kill()
        raise TimeoutError(f"rollouts.server at {url} does not accept connections") from None
      time.sleep(0.05)


def local_engine(cfg, params, version: int, *, servers: int = 1, weights_dir: str = "",
                 max_batch: int = 64, router: bool = False,
                 cores: Sequence[int] = (), checkpoint: str = "",
                 export_dtype: str | None = None, memory_saver: bool = False,
                 weight_format: str | None = None):
  """The engine factory (train.engine) that serves the policy from `servers` subprocesses of this module
  on 127.0.0.1 and talks to them with the SGLang client (rollouts/sglang.py): the production
  path, minus the GPUs. Weights travel through `weights_dir` (default: a temporary
  directory) as Hugging Face checkpoints. `max_batch`: the most requests a server decodes at
  once, and so the most the client keeps in flight on each (more would only queue there).
  `router`: /generate goes through the real
  sglang-router in front of them (rollouts/router.py), started and stopped with the engine.
  `cores`: the CPU cores the servers run on (e.g. apart from the trainer's). `checkpoint`: the
  Hugging Face directory the run starts from (rl.pretrained.HFCheckpoint's path): the servers
  start from it as it is, and every weight export carries its tokenizer files.
  `export_dtype`: the exported weights' dtype (SGLangEngine; default the model's compute
  dtype), which the servers are started with (--dtype). `memory_saver`: they start with
  --enable-memory-saver (RLConfig.hybrid: they free their memory between generations).
  `weight_format` ("fp8"): they start from, and are refit with, quantized exports
  (SGLangEngine), the starting weights included: from `checkpoint` too they start from its
  quantized export, the quantization being fixed when a server starts; "int4" is refused,
  as it is for SGLang (rollouts/sglang.py refusals). A mixture of experts' servers start
  with --enable-return-routed-experts (rollout routing replay)."""
  refused = sglang.refusals(cfg, weight_format)
  if refused:
    raise sglang.Unservable(refused)
  weights_dir = weights_dir or tempfile.mkdtemp(prefix="longrl-weights-")
  os.makedirs(weights_dir, exist_ok=True)
  export_dtype = export_dtype or cfg.dtype
  exported = dataclasses.replace(cfg, param_dtype=export_dtype)
  start = (checkpoint if checkpoint and weight_format is None else
           hf.save(params, exported, os.path.join(weights_dir, f"v{version:06d}"),
                   copy_from=checkpoint or None, quantization=weight_format))
  processes, urls = [], []
  try:
    for _ in range(servers):
      process, url = launch(["--hf_checkpoint", start, "--weight_version", str(version),
                             "--max_batch", str(max_batch), "--dtype", export_dtype,
                             *(["--enable-memory-saver"] if memory_saver else []),
                             *(["--enable-return-routed-experts"] if cfg.moe else [])],
                            cores=cores)
      processes.append(process)
      urls.append(url)
    router_url = None
    if router:
      router_process, router_url = router_lib.launch(urls)
      processes.append(router_process)
  except BaseException:
    for process in processes:
      process.kill()
    raise
  engine = sglang.SGLangEngine(
      sglang.SGLangClient(urls, router=router_url, max_in_flight=max_batch), cfg,
      weights_dir=weights_dir, copy_from=checkpoint or None, version=version,
      weights_path=start, processes=processes, export_dtype=export_dtype,
      weight_format=weight_format)
  try:
    engine.client.check_health()
    engine.context_length = engine.client.context_length()
  except BaseException:
    engine.close()
    raise
  return engine


local_engine.capabilities = sglang.CAPABILITIES  # known before it makes one


if __name__ == "__main__":
  main()
