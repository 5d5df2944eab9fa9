"""Rollouts from external SGLang servers over plain HTTP (never `import sglang`).

Owns the client side of SGLang's native protocol (sglang 0.5.23; every field it sends and
reads, with the line of SGLang that defines it, is in docs/sglang.md): token-in/token-out
/generate with our own rids and n=1 per request (groups are fanned out here), tokens and
log-probs from meta_info.output_token_logprobs, finish reasons, a bounded number of requests
in flight per server, trajectory-to-server affinity (prefix-cache reuse) or one sglang-router
URL, long read timeouts, bounded retries (each attempt under a rid of its own: SGLang refuses
a rid still alive), aborts by the exact rids in flight (SGLang drops a rid it does not know),
prompt scoring from the position before the first scored token (SGLang's entry there is
null), and weight sync from disk with the version checked through /model_info, the worker
always resumed. Every call has a deadline, and a call's requests are aborted when its
`stop_when` says so. rollouts/sglang_engine.py puts it behind the RolloutEngine protocol. It
does not own when rollouts pause (rl/envs/driver.py, rl/sources.py) or the server (an SGLang
deployment, or rollouts/server/ in tests).

Images (a vision-language model's, `SGLangEngine.generate(images=)`) go as each request's
image_data: data URLs of PNG bytes of every image's RGB pixels, in the order of its runs of
image tokens (rollouts/image_data.py); a request without images sends none. The trainer's
prompts hold an image as one token per merged patch; SGLang takes one token per image and
expands it by the image's size (base_processor.py _expand_input_ids, with
SGLANG_MM_AVOID_RETOKENIZE on), so each run is sent as one token, continuations (prompt +
tokens so far) alike. Such requests ask for return_prompt_token_ids, the ids after that
expansion (tokenizer_manager.py generate_request), and a server whose expansion is not the
trainer's (other min/max pixels) is a ServerError naming both counts (check_expansion).
docs/sglang.md 3(j) has the lines.

Log-probs are SGLang's: log_softmax(logits / temperature) over the whole vocabulary, before
top-p; at temperature 1 that is what the trainer recomputes.
"""

import asyncio
import base64
import dataclasses
import itertools
import json
import threading
import time
from typing import Any, Callable, Sequence

import aiohttp
import numpy as np

from rollouts import image_data
from rollouts import router as router_lib
from rollouts.engine import Completion, SamplingParams

FINISH_TYPES = ("stop", "length", "abort")
# The calls SGLang marks ADMIN_OPTIONAL, which take the admin key when the server has one
# (srt/entrypoints/http_server.py L1025, L1300, L1575, L1587, L1652-1684, L1721, L1831,
# L1844); the others (/generate, /model_info, /server_info, /v1/loads) take the API key.
ADMIN_CALLS = frozenset({"/flush_cache", "/update_weights_from_disk",
                         "/release_memory_occupation", "/resume_memory_occupation",
                         "/abort_request", "/pause_generation", "/continue_generation",
                         "/load_lora_adapter", "/unload_lora_adapter"})
# "1" in a reproducible run (rl.trainer.make_deterministic): servers must then honour seeds.
DETERMINISTIC_ENV = "LONGRL_DETERMINISTIC"


class ServerError(RuntimeError):
  """A server is down, answered an HTTP error, or answered JSON of the wrong shape. Names the
  server and what it said; `completed` holds the completions received before the failure
  (request index -> Completion) so that no finished work is lost."""

  def __init__(self, message: str, *, completed: dict[int, Completion] | None = None):
    super().__init__(message)
    self.completed = completed or {}


@dataclasses.dataclass(frozen=True)
class RequestImages:
  """A request's images: `data`, what is sent as its image_data (data URLs, in the order of
  its placeholders), and `expanded`, its input ids with each image token repeated for every
  merged patch of its image (`image_token_id`), which the server's prompt_token_ids must
  equal."""
  data: tuple[str, ...]
  expanded: tuple[int, ...]
  image_token_id: int


@dataclasses.dataclass(frozen=True)
class Request:
  """One trajectory's /generate call. `affinity` picks the server (same key, same server);
  `input_ids` may be prompt + an earlier partial completion (partial rollouts); with
  `images`, one image token stands for each image (image_data.collapse)."""
  rid: str
  input_ids: tuple[int, ...]
  max_new_tokens: int
  affinity: int = 0
  sampling_seed: int | None = None
  images: RequestImages | None = None
  # The LoRA adapter it runs on (its name on the servers: lora_path) and that adapter's
  # version, which every token it makes is tagged with (a server's weight_version is its
  # base's); None: the base.
  adapter: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class RoutesLayout:
  """How to read a mixture's meta_info.routed_experts: the model's decoder layers, its sparse
  ones, experts per token."""
  num_layers: int
  sparse_layers: tuple[int, ...]
  k: int

  @classmethod
  def of(cls, cfg) -> "RoutesLayout | None":
    """The layout of `cfg`'s routes (None for a dense model)."""
    if cfg.moe is None:
      return None
    return cls(cfg.num_layers, cfg.sparse_layers, cfg.moe.experts_per_token)

  def decode(self, text: str) -> np.ndarray:
    """i32[rows, sparse layers, k] from SGLang's encoding: base64 of int32 bytes [rows,
    num_layers, k], every decoder layer's (a dense one's 0) (tokenizer_manager.py
    L2602-2609; routed_experts.py L166-174 decodes it so)."""
    flat = np.frombuffer(base64.b64decode(text), "<i4")
    return flat.reshape(-1, self.num_layers, self.k)[:, list(self.sparse_layers)].astype(np.int32)


def request_body(request: Request, sampling: SamplingParams, *,
                 routed_experts: bool = False) -> dict[str, Any]:
  """The /generate body: only keys SGLang's contract accepts (an unknown sampling key is a
  400 there), the shape slime and AReaL send; `routed_experts`: also return_routed_experts
  (GenerateReqInput's, io_struct.py L263-268: FastAPI parses the body into it, so it gets
  through though the JSON contract does not list it), from the first input token on. A
  request with images sends them as image_data (a list: one request's images,
  tokenizer_manager.py _tokenize_one_request) and asks for return_prompt_token_ids, the ids
  after SGLang expanded each image token (check_expansion)."""
  params = {"max_new_tokens": request.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": -1, "min_p": 0.0,
            "stop_token_ids": list(sampling.stop_token_ids), "skip_special_tokens": False,
            "no_stop_trim": True, "n": 1}
  if request.sampling_seed is not None:
    params["sampling_seed"] = request.sampling_seed
  body = {"rid": request.rid, "input_ids": list(request.input_ids), "sampling_params": params,
          "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0,
          "return_text_in_logprobs": False, "stream": False}
  if routed_experts:
    body.update(return_routed_experts=True, routed_experts_start_len=0)
  if request.images is not None:
    body.update(image_data=list(request.images.data), return_prompt_token_ids=True)
  if request.adapter is not None:  # GenerateReqInput.lora_path (io_struct.py L276-279)
    body["lora_path"] = request.adapter[0]
  return body


def check_expansion(server: str, body: Any, request: Request) -> None:
  """ServerError unless the server's prompt_token_ids (`body`, a /generate response) are
  the request's expanded ids: else it would decode, and report log-probs, on another count
  of image tokens than the trainer computes."""
  got = body.get("prompt_token_ids") if isinstance(body, dict) else None
  want = list(request.images.expanded)
  if got == want:
    return
  if not isinstance(got, list):
    raise ServerError(f"{server}/generate answered no prompt_token_ids for {request.rid}, "
                      "asked with return_prompt_token_ids (SGLang >= 0.5 returns them)")
  theirs = image_data.run_lengths(got, request.images.image_token_id)
  ours = image_data.run_lengths(want, request.images.image_token_id)
  if theirs != ours:
    raise ServerError(
        f"{server}/generate expanded the images of {request.rid} to {theirs} image tokens, "
        f"the trainer to {ours}: the server resizes images otherwise than the model's "
        "VisionConfig (min_pixels / max_pixels of its preprocessor_config.json, or its "
        "--mm-process-config), and the trainer would score other tokens than it generated")
  at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
  raise ServerError(f"{server}/generate: the prompt_token_ids of {request.rid} differ from "
                    f"the trainer's at position {at} ({len(got)} and {len(want)} tokens)")


def _version(text: str | None) -> int:
  try:
    return int(text)
  except (TypeError, ValueError):
    return -1  # "default" (a server started without --weight-version)


def parse_response(server: str, body: Any, routes: RoutesLayout | None = None) -> Completion:
  """A Completion from a /generate response (with `routes`, its routed_experts where the
  server returned them: one started with --enable-return-routed-experts); ServerError if
  the shape is wrong."""
  def wrong(what):
    return ServerError(f"{server}/generate answered JSON of the wrong shape ({what}): "
                       f"{str(body)[:300]}")
  if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
    raise wrong("no meta_info object")
  meta = body["meta_info"]
  reason = meta.get("finish_reason")
  if not isinstance(reason, dict) or reason.get("type") not in FINISH_TYPES:
    raise wrong("finish_reason.type is not stop, length or abort")
  entries = meta.get("output_token_logprobs")
  if entries is None and not body.get("output_ids"):
    entries = []  # aborted in the waiting queue: nothing generated
  if not isinstance(entries, list) or not all(
      isinstance(e, list) and len(e) == 3 and isinstance(e[1], int) for e in entries):
    raise wrong("output_token_logprobs is not a list of [logprob, token_id, text]")
  tokens = np.array([e[1] for e in entries], np.int32)
  output_ids = body.get("output_ids")
  if output_ids is not None and list(output_ids) != tokens.tolist():
    raise wrong("output_ids disagree with output_token_logprobs")
  logprobs = np.array([0.0 if e[0] is None else e[0] for e in entries], np.float32)
  versions = np.full(len(tokens), _version(meta.get("weight_version")), np.int32)
  for span in meta.get("weight_versions") or []:
    versions[span["start"]:span["end"]] = _version(span["version"])
  routed = meta.get("routed_experts") if routes is not None else None
  if routed is not None:
    try:
      routed = routes.decode(routed)
    except (ValueError, TypeError) as error:
      raise wrong(f"routed_experts is not base64 int32 [rows, {routes.num_layers}, "
                  f"{routes.k}]: {error}") from None
  return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=reason["type"],
                    versions=versions, routed_experts=routed)


def parse_scores(server: str, body: Any, tokens: Sequence[int], top_k: int = 0
                 ) -> tuple[np.ndarray, int] | tuple[np.ndarray, int, np.ndarray, np.ndarray]:
  """(log-probs of tokens[1:], weight version) from a prompt-scoring /generate response asked
  from the position of tokens[0] (logprob_start_len): SGLang's entry for that position, and
  its top-k row, are null (logprob_result_processor.py L33-38, L66-81) and are dropped. With
  top_k > 0 also the top-k token ids and log-probs at each scored position, i32 / f32[n, k]
  (meta_info.input_top_logprobs)."""
  entries = body.get("meta_info", {}).get("input_token_logprobs") if isinstance(body, dict) \
      else None
  # SGLang reports an input token id >= vocab_size - 1 as 0 (logprob_result_processor.py
  # L53-56): 0 stands for any id there.
  if not isinstance(entries, list) or len(entries) != len(tokens) or not all(
      isinstance(e, list) and len(e) == 3 and e[1] in (t, 0) for e, t in zip(entries, tokens)):
    raise ServerError(f"{server}/generate: input_token_logprobs do not cover the "
                      f"{len(tokens)} tokens asked for: {str(body)[:300]}")
  entries = entries[1:]
  if any(e[0] is None for e in entries):
    raise ServerError(f"{server}/generate: a scored token has no log-prob")
  scores = (np.array([e[0] for e in entries], np.float32),
            _version(body["meta_info"].get("weight_version")))
  if not top_k:
    return scores
  rows = body["meta_info"].get("input_top_logprobs")
  rows = rows[1:] if isinstance(rows, list) and len(rows) == len(entries) + 1 else None
  if not isinstance(rows, list) or len(rows) != len(entries) or not all(
      isinstance(row, list) and len(row) == top_k and all(
          isinstance(e, list) and len(e) >= 2 and e[0] is not None for e in row)
      for row in rows):
    raise ServerError(f"{server}/generate: input_top_logprobs do not give {top_k} tokens at "
                      f"each of the {len(entries)} scored positions: {str(body)[:300]}")
  return (*scores, np.array([[e[1] for e in row] for row in rows], np.int32).reshape(-1, top_k),
          np.array([[e[0] for e in row] for row in rows], np.float32).reshape(-1, top_k))


@dataclasses.dataclass(eq=False)
class _Call:
  """One generate or score call's requests in flight (rid -> the server it went to) and
  whether the call is stopping them (aborting what runs)."""
  in_flight: dict[str, str] = dataclasses.field(default_factory=dict)
  stopping: bool = False


class _Retry(Exception):
  """An attempt that failed in a way worth another: no connection, a timeout, or a 5xx
  (`status`)."""

  def __init__(self, why: str, status: int | None = None):
    super().__init__(why)
    self.status = status


class SGLangClient:
  """Talks to SGLang workers `urls` (each a base URL such as http://10.0.0.5:30000).

  /generate goes to `router` when given (an sglang-router / Model Gateway URL), else to the
  worker chosen by the request's affinity key; control calls (health, pause, weight updates,
  aborts) always go to every worker. A worker that cannot be reached, or that answers a 5xx,
  is retried `retries` times (a request under a fresh rid each time), then marked down and
  its requests move to the next live worker; results already received are kept. The router
  answering 503 (no healthy worker: SGLang's /health blocks while a worker loads weights) is
  waited out for up to `unavailable_wait` s.

  Deadlines: a /generate call may take `read_timeout` s between bytes (a long chain of
  thought); every control call (pause, update, continue, abort, /model_info, ...) answers
  within `control_timeout` s or is retried, then fails naming the server and the call.

  A stopped call's requests are aborted by rid; one still running `abort_grace` s after its
  first abort, which SGLang may have spent before the request reached its scheduler, has its
  worker aborted whole (_abort_until_returned).

  Keys, as SGLang checks them (srt/utils/auth.py decide_request_auth): /generate,
  /model_info and /server_info carry `api_key` (needed when the server has --api-key); the
  control calls (pause, continue, aborts, weight updates, memory, /flush_cache: ADMIN_OPTIONAL
  in http_server.py) carry `admin_api_key`, or `api_key` when there is no admin key (a server
  with --admin-api-key takes only that one there); /health needs none.
  """

  def __init__(self, urls: Sequence[str], *, router: str | None = None,
               max_in_flight: int = 64, read_timeout: float = 3600.0,
               connect_timeout: float = 10.0, retries: int = 2, retry_backoff: float = 0.5,
               api_key: str | None = None, admin_api_key: str | None = None,
               control_timeout: float = 600.0, unavailable_wait: float = 300.0,
               abort_grace: float = 1.0):
    if not urls:
      raise ValueError("SGLangClient needs at least one server URL")
    self.urls = [u.rstrip("/") for u in urls]
    self.router = router.rstrip("/") if router else None
    self.max_in_flight, self.retries, self.retry_backoff = max_in_flight, retries, retry_backoff
    self.unavailable_wait, self.abort_grace = unavailable_wait, abort_grace
    self._calls: set[_Call] = set()  # the calls running (on the event-loop thread)
    self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                         sock_read=read_timeout)
    self.control_timeout = aiohttp.ClientTimeout(total=control_timeout,
                                                 sock_connect=connect_timeout)
    bearer = lambda key: {"Authorization": f"Bearer {key}"} if key else {}
    self.headers, self.admin_headers = bearer(api_key), bearer(admin_api_key or api_key)
    self.down: set[str] = set()
    self.released: set[str] = set()  # workers whose memory release_memory released
    # One event loop on a thread of its own, with one connection pool: connections are kept
    # alive between calls (a fresh TCP connection per request costs more than a short
    # completion), and sync callers work inside a notebook's running loop too.
    self._loop = asyncio.new_event_loop()
    threading.Thread(target=self._loop.run_forever, daemon=True, name="sglang-client").start()
    self._http = self._run(self._open())
    # Control calls (aborts above all) get connections of their own: behind a pool whose
    # connections all carry long /generate calls they would wait for a new one.
    self._control = self._run(self._open())

  async def _open(self) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=self.timeout,
                                 connector=aiohttp.TCPConnector(limit=0, force_close=False))

  def _run(self, coroutine):
    return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

  def close(self) -> None:
    if not self._loop.is_closed():
      self._run(self._http.close())
      self._run(self._control.close())
      self._loop.call_soon_threadsafe(self._loop.stop)

  # --- plumbing

  async def _attempt(self, http: aiohttp.ClientSession, server: str, method: str, path: str,
                     body: dict | None = None, headers: dict | None = None,
                     timeout: aiohttp.ClientTimeout | None = None) -> Any:
    """JSON (or None for an empty body) of one call; _Retry on no connection, a timeout
    (`timeout`; by default control calls' control_timeout, /generate's read_timeout) or a
    5xx; ServerError on a 4xx."""
    timeout = timeout or (self.control_timeout if http is self._control else None)
    keys = self.admin_headers if path in ADMIN_CALLS else self.headers
    try:
      async with http.request(method, server + path, json=body, timeout=timeout,
                              headers={**keys, **(headers or {})}) as reply:
        status, text = reply.status, await reply.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
      raise _Retry(f"{type(e).__name__}: {e}") from None
    if status >= 500:
      raise _Retry(f"HTTP {status}: {text[:300]}", status)
    if status >= 400:
      raise ServerError(f"{server}{path} answered HTTP {status}: {text[:300]}")
    if not text:
      return None
    try:
      return json.loads(text)
    except ValueError:
      return text

  async def _call(self, http: aiohttp.ClientSession, server: str, method: str, path: str,
                  body: dict | None = None, headers: dict | None = None,
                  timeout: aiohttp.ClientTimeout | None = None) -> Any:
    """_attempt, retried `retries` times; ConnectionError naming the call after the last."""
    for attempt in range(self.retries + 1):
      if attempt:
        await asyncio.sleep(self.retry_backoff * 2 ** (attempt - 1))
      try:
        return await self._attempt(http, server, method, path, body, headers, timeout)
      except _Retry as e:
        last = str(e)
    raise ConnectionError(f"{server}{path} failed after {self.retries + 1} attempts: {last}")

  def _live(self) -> list[str]:
    return [u for u in self.urls if u not in self.down]

  # --- generation

  async def _post_generate(self, body: dict, affinity: int, limits: dict, results: dict,
                           total: int, in_flight: dict[str, str],
                           cancelled: Callable[[], bool] = lambda: False):
    """(server, JSON reply) of one /generate call: through the router, else on the live
    worker `affinity` picks, moving to the next live worker when one fails `retries` + 1
    times; None once `cancelled()` before it was sent. Attempt k goes as rid `rid#k`
    (SGLang refuses a rid it still holds, tokenizer_manager.py L3833-3836, and a timed-out
    attempt may still run there), recorded in `in_flight` (rid -> server) while it runs.
    Errors carry the `results` received."""
    attempts, failures, unavailable_since = itertools.count(), 0, None
    while True:
      if cancelled():
        return None
      if self.router:
        server, limit = self.router, limits[None]
      else:
        live = self._live()
        if not live:
          raise ServerError(f"every server is down ({', '.join(self.urls)}); {len(results)} "
                            f"of {total} results were received and are kept",
                            completed=results)
        server = live[affinity % len(live)]
        limit = limits[server]
      # Behind the router (--policy manual) the key pins the request to one worker, as
      # `affinity` does here without one.
      headers = {"X-SMG-Routing-Key": str(affinity)} if self.router else None
      rid = f"{body['rid']}#{next(attempts)}"
      async with limit:
        if cancelled():  # the call stopped while this one waited for room
          return None
        in_flight[rid] = server
        try:
          return server, await self._attempt(self._http, server, "POST", "/generate",
                                             {**body, "rid": rid}, headers)
        except _Retry as e:
          failed = e
        finally:
          in_flight.pop(rid, None)
      if self.router and failed.status == 503:
        unavailable_since = unavailable_since or time.monotonic()
        if time.monotonic() - unavailable_since < self.unavailable_wait:
          await asyncio.sleep(min(self.retry_backoff * 2, 2.0))
          continue  # no healthy worker yet (e.g. all loading weights)
      failures += 1
      if failures <= self.retries:
        await asyncio.sleep(self.retry_backoff * 2 ** (failures - 1))
        continue
      if self.router:
        raise ServerError(f"router {server} failed: {server}/generate failed after {failures}"
                          f" attempts: {failed}", completed=results)
      self.down.add(server)
      failures = 0

  def _limits(self) -> dict:
    """In-flight limits per worker, and for the router (key None)."""
    limits = {u: asyncio.Semaphore(self.max_in_flight) for u in self.urls}
    limits[None] = asyncio.Semaphore(self.max_in_flight * len(self.urls))
    return limits

  async def _gather(self, calls, results: dict, total: int, helpers: Sequence = ()) -> list:
    """Run `calls`; `helpers` (tasks such as an aborter) are cancelled once they end."""
    tasks = [asyncio.create_task(c) for c in calls]
    try:
      await asyncio.gather(*tasks)
    except ServerError as e:
      for t in tasks:
        t.cancel()
      e.completed = results
      raise
    finally:
      for helper in helpers:
        helper.cancel()
    return [results[i] for i in range(total)]

  async def _abort_until_returned(self, call: _Call) -> None:
    """Abort each rid of `call` in flight by its exact rid, on its worker (every worker when
    it went through the router), again every half second until none is left: a request not
    yet registered on its worker when its abort arrived is not aborted (SGLang drops an
    unknown rid, tokenizer_manager.py L2246-2253).

    SGLang passes on only the first abort of a rid it knows (abort_sent, L2249-2251), and
    that one is lost when the request has not reached its scheduler yet: while its images
    are loaded and processed (L926 registers the rid, L1202-1217 then await), or while it
    waits out a pause or a weight update (L938-942). The request then runs to its whole
    max_new_tokens. So a rid still running `abort_grace` s after its first abort has its
    worker aborted whole (abort_all), again every half second, once no call that is not
    stopping has requests there: only this client's calls are known, so a fleet shared with
    another client loses that client's requests in flight too."""
    first: dict[str, float] = {}
    while call.in_flight:
      now = time.monotonic()
      workers = {rid: self._live() if server == self.router else [server]
                 for rid, server in list(call.in_flight.items())}
      calls = [self._call(self._control, worker, "POST", "/abort_request", {"rid": rid})
               for rid, those in workers.items() for worker in those]
      stuck = {worker for rid, those in workers.items()
               if now - first.setdefault(rid, now) > self.abort_grace for worker in those}
      calls += [self._call(self._control, worker, "POST", "/abort_request", {"abort_all": True})
                for worker in stuck if self._only_stopping_on(worker)]
      await asyncio.gather(*calls, return_exceptions=True)  # a dead worker aborts nothing
      await asyncio.sleep(0.5)

  def _only_stopping_on(self, worker: str) -> bool:
    """Whether every call of this client with requests on `worker` (directly or through the
    router) is stopping them."""
    return all(c.stopping for c in self._calls
               if any(s in (worker, self.router) for s in c.in_flight.values()))

  async def _generate(self, requests: Sequence[Request], sampling: SamplingParams,
                      stop_when: Callable[[int, Completion], bool] | None,
                      on_ready: Callable[[dict[int, Completion]], None] | None,
                      routes: RoutesLayout | None):
    results: dict[int, Completion] = {}
    call = _Call()
    limits = self._limits()
    aborter = []

    async def one(index: int, request: Request):
      sent = await self._post_generate(
          request_body(request, sampling, routed_experts=routes is not None),
          request.affinity, limits, results, len(requests), call.in_flight,
          lambda: call.stopping)
      if sent is None:  # the iteration ended before this request was sent
        completion = Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), "abort",
                                np.zeros(0, np.int32))
      else:
        completion = parse_response(*sent, routes)
        if request.adapter is not None:
          completion = dataclasses.replace(completion, versions=np.full_like(
              completion.versions, request.adapter[1]))
        if request.images is not None:
          check_expansion(*sent, request)
      results[index] = completion
      if on_ready is not None:
        on_ready({index: completion})
      if sent is None:
        return
      if stop_when is not None and not call.stopping and stop_when(index, completion):
        call.stopping = True  # the rest come back aborted, with what they generated so far
        aborter.append(asyncio.create_task(self._abort_until_returned(call)))

    self._calls.add(call)
    try:
      return await self._gather([one(i, r) for i, r in enumerate(requests)], results,
                                len(requests), aborter)
    finally:
      self._calls.discard(call)

  async def _score(self, requests: Sequence[Request], starts: Sequence[int], top_k: int):
    results: dict[int, tuple] = {}
    limits = self._limits()
    call = _Call()  # known to other calls' aborts (_only_stopping_on)

    async def one(index: int, request: Request, start: int):
      # From the token before the first scored one: SGLang's entry at logprob_start_len is
      # null (parse_scores).
      body = {"rid": request.rid, "input_ids": list(request.input_ids),
              "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "n": 1},
              "return_logprob": True, "logprob_start_len": start - 1,
              "top_logprobs_num": top_k, "return_text_in_logprobs": False, "stream": False}
      server, reply = await self._post_generate(body, request.affinity, limits, results,
                                                len(requests), call.in_flight)
      results[index] = parse_scores(server, reply, request.input_ids[start - 1:], top_k)

    self._calls.add(call)
    try:
      return await self._gather(
          [one(i, r, s) for i, (r, s) in enumerate(zip(requests, starts))], results,
          len(requests))
    finally:
      self._calls.discard(call)

  def score(self, requests: Sequence[Request], starts: Sequence[int], *, top_k: int = 0
            ) -> list[tuple]:
    """(log-probs f32[len(input_ids) - start], weight version) per request: SGLang's prompt
    scoring, a /generate with max_new_tokens 0 and logprob_start_len = start - 1 (start >= 1).
    With
    top_k > 0 (top_logprobs_num) each tuple also holds the top-k ids and log-probs at those
    positions, i32 / f32[len(input_ids) - start, top_k]."""
    if any(s < 1 for s in starts):
      raise ValueError("SGLangClient.score: every start must be >= 1 (the first token has "
                       "no log-prob)")
    return self._run(self._score(requests, starts, top_k))

  def generate(self, requests: Sequence[Request], sampling: SamplingParams, *,
               stop_when: Callable[[int, Completion], bool] | None = None,
               on_ready: Callable[[dict[int, Completion]], None] | None = None,
               routes: RoutesLayout | None = None) -> list[Completion]:
    """Completions in request order; with `routes`, a mixture's routed experts asked for
    and read so. `on_ready({index: completion})` is called (on the
    client's event-loop thread) as each one arrives. `stop_when(index, completion)` is
    asked as each one arrives; once it says True, requests not yet sent are not sent and
    those in flight are aborted by their rids: they return "abort" with the tokens generated
    so far (partial rollouts)."""
    return self._run(self._generate(requests, sampling, stop_when, on_ready, routes))

  # --- control, sent to every worker

  async def _each(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
    return await self._each_async(self._control, method, path, body)

  async def _each_async(self, http, method: str, path: str, body: dict | None = None
                        ) -> dict[str, Any]:
    return await self._each_worker(
        lambda http, url: self._call(http, url, method, path, body), path, http)

  async def _each_worker(self, call, what: str, http=None) -> dict[str, Any]:
    """{url: await call(http, url)} over the live workers at once; ServerError naming the
    first that failed and `what` it was asked."""
    http = http or self._control
    live = self._live()
    replies = await asyncio.gather(*(call(http, u) for u in live), return_exceptions=True)
    for url, reply in zip(live, replies):
      if isinstance(reply, BaseException):
        raise ServerError(f"{url}{what}: {reply}") from reply
    return dict(zip(live, replies))

  def check_health(self, timeout: float = 30.0) -> None:
    """Wait until every worker's GET /health answers 200, at most `timeout` s: a starting
    SGLang refuses connections until it has loaded the model, then answers 503 until its
    warm-up request is done (http_server.py L735-736). ServerError naming each one that did
    not, and what it answered last."""
    async def wait(url):
      deadline = time.monotonic() + timeout
      while True:
        why = await self._unhealthy(url, max(1.0, deadline - time.monotonic()))
        if why is None or time.monotonic() >= deadline:
          return why
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def probe():
      return await asyncio.gather(*(wait(u) for u in self.urls))
    failures = [f"{u} ({why})" for u, why in zip(self.urls, self._run(probe())) if why]
    if failures:
      raise ServerError(f"SGLang server(s) not healthy within {timeout:g} s: "
                        + "; ".join(failures))
    self.down.clear()

  async def _unhealthy(self, url: str, timeout: float) -> str | None:
    """Why GET url/health does not answer 200 (None when it does)."""
    try:
      async with self._control.get(url + "/health",
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
        return None if reply.status == 200 else f"HTTP {reply.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
      return f"{type(e).__name__}: {e}"

  def context_length(self) -> int | None:
    """The fewest tokens (prompt + completion) any worker takes in one request: its
    /server_info context_length (SGLang's --context-length, else config.json's, from
    model_config.py _derive_context_length; it refuses input + max_new_tokens above it,
    tokenizer_manager.py L1351-1377); None when no worker reports one."""
    info = self._run(self._each("GET", "/server_info"))
    lengths = [i["context_length"] for i in info.values()
               if isinstance(i, dict) and isinstance(i.get("context_length"), int)]
    return min(lengths) if lengths else None

  def abort_all(self) -> None:
    """Abort every request on every worker (also other callers'); they return partial output
    to their callers. (A call's own requests are aborted by their rids: generate's
    stop_when.)"""
    self._run(self._each("POST", "/abort_request", {"abort_all": True}))

  def check_started_with(self, flag: str, needed_by: str) -> None:
    """ServerError naming each worker whose /server_info does not show `flag` (e.g.
    --enable-memory-saver) set, which `needed_by` needs. /server_info lists every server
    argument by its field name (http_server.py L885 = ServerArgs.resolved_dict,
    server_args.py L316-333)."""
    field = flag.lstrip("-").replace("-", "_")
    info = self._run(self._each("GET", "/server_info"))
    missing = [u for u, i in info.items() if not (isinstance(i, dict) and i.get(field))]
    if missing:
      raise ServerError(f"{needed_by} needs servers started with {flag}; "
                        f"{', '.join(missing)} were not")

  def load_adapter(self, name: str, path: str) -> None:
    """Every live worker loads PEFT directory `path` as LoRA adapter `name`
    (/load_lora_adapter); ServerError naming a worker that refuses it, with its message."""
    self._run(self._each("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}))

  def unload_adapter(self, name: str) -> None:
    """Every live worker unloads adapter `name`, each once no request uses it (SGLang
    unregisters it, then waits for them: tokenizer_control_mixin.py L634-657)."""
    self._run(self._each("POST", "/unload_lora_adapter", {"lora_name": name}))

  def release_memory(self) -> float:
    """A hybrid deployment's switch to training: every worker pauses (mode abort: nothing
    runs, and what arrives meanwhile, such as the router's health checks, waits) and then
    releases its weights, KV cache and CUDA graphs (/release_memory_occupation, all tags). It
    must be idle: SGLang asserts so, and a health check that ran on released memory would
    take it down (weight_updater.py L337-381). The next sync_weights takes the memory back
    around its load. Returns the seconds."""
    started = time.perf_counter()

    async def release(http, url):
      await self._call(http, url, "POST", "/pause_generation", {"mode": "abort"})
      await self._call(http, url, "POST", "/release_memory_occupation", {})
      self.released.add(url)
    self._run(self._each_worker(release, "/release_memory_occupation"))
    return time.perf_counter() - started

  def model_info(self) -> dict[str, dict]:
    return self._run(self._each("GET", "/model_info"))

  def loads(self) -> dict[str, dict]:
    return self._run(self._each("GET", "/v1/loads"))

  def sync_weights(self, model_path: str, version: int, *, in_flight: str = "abort") -> float:
    """Per worker, in parallel: pause, /update_weights_from_disk with `weight_version`, check
    success, continue; then check /model_info reports the version. `in_flight`: "abort"
    pauses with abort (requests in flight return cut short); "finish" does not pause, so a
    server finishes the requests in flight on the old weights (their tokens tagged with its
    version) and holds new ones until the update is done (SGLang's model-update lock).
    A worker that cannot be reached is marked down (its requests go elsewhere); a down one
    that answers /health again is synced too and rejoins at this version. ServerError when
    no worker could be synced, or one answers but fails the update. Returns the seconds."""
    started = time.perf_counter()

    async def sync():
      down = sorted(self.down)
      back = [u for u, why in zip(down, await asyncio.gather(
          *(self._unhealthy(u, 5.0) for u in down))) if why is None]
      self.down -= set(back)
      targets = self._live()
      results = await asyncio.gather(*(self._sync_one(u, model_path, version, in_flight)
                                       for u in targets), return_exceptions=True)
      for url, result in zip(targets, results):
        if isinstance(result, ConnectionError):
          self.down.add(url)
        elif isinstance(result, BaseException):
          raise result
      if not self._live():
        raise ServerError(f"weight sync to version {version}: no server could be reached "
                          f"({'; '.join(f'{u}: {r}' for u, r in zip(targets, results))})")
      if self.router:
        await self._wait_routed(self._live())
    self._run(sync())
    return time.perf_counter() - started

  async def _wait_routed(self, urls: Sequence[str]) -> None:
    """Until the router lists `urls` healthy again, at most unavailable_wait s (ServerError
    naming the rest): SGLang's /health blocks while a worker loads weights (http_server.py
    L721-800), so the router may have marked it unhealthy meanwhile."""
    deadline = time.monotonic() + self.unavailable_wait
    while True:
      listed = await asyncio.to_thread(router_lib.workers, self.router)
      missing = set(urls) - {w.get("url") for w in listed if w.get("is_healthy")}
      if not missing:
        return
      if time.monotonic() > deadline:
        raise ServerError(f"router {self.router} does not list {sorted(missing)} as healthy "
                          f"{self.unavailable_wait:.0f} s after their weight update")
      await asyncio.sleep(0.2)

  async def _sync_one(self, url: str, model_path: str, version: int,
                      in_flight: str = "abort") -> None:
    """One worker: pause (with in_flight "abort"), take back released weights, load
    `model_path` as `version`, take back the released KV cache, continue, check. (verl and
    slime resume in this order: the load's buffers need room before the cache takes it.)"""
    if in_flight not in ("abort", "finish"):
      raise ValueError(f"in_flight must be 'abort' or 'finish', got {in_flight!r}")
    http = self._control
    released = url in self.released
    if in_flight == "abort":
      await self._call(http, url, "POST", "/pause_generation", {"mode": "abort"})
    try:
      if released:  # the weights first, loaded before the KV cache takes its room back
        await self._call(http, url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
      # Unpaused, SGLang's update first waits for the requests in flight to finish
      # (tokenizer_manager.py L2302-2309): as long as a generation may take.
      reply = await self._call(http, url, "POST", "/update_weights_from_disk",
                               {"model_path": model_path, "weight_version": str(version),
                                "flush_cache": True, "abort_all_requests": False},
                               timeout=self.timeout if in_flight == "finish" else None)
      if not isinstance(reply, dict) or not reply.get("success"):
        raise ServerError(f"{url}/update_weights_from_disk failed: {reply}")
    finally:  # also after a failed update: a paused worker makes every later request wait
      if released:  # before any request (a health check) meets released memory
        await self._call(http, url, "POST", "/resume_memory_occupation",
                         {"tags": ["kv_cache", "cuda_graph"]})
        self.released.discard(url)
      await self._call(http, url, "POST", "/continue_generation", {})
    info = await self._call(http, url, "GET", "/model_info")
    if not isinstance(info, dict) or info.get("weight_version") != str(version):
      raise ServerError(f"{url} reports weight_version "
                        f"{info.get('weight_version') if isinstance(info, dict) else info!r}"
                        f" after the update to {version}")

  def add_worker(self, url: str, model_path: str, version: int) -> None:
    """A new worker joins at the current weights: it loads `model_path` as `version` first
    (ServerError, and it is not added, if it cannot), then this client uses it and, with a
    router, the router is told of it, so that no request reaches it on other weights."""
    url = url.rstrip("/")
    try:
      self._run(self._sync_one(url, model_path, version))
    except ConnectionError as e:
      raise ServerError(f"new worker {url}: {e}") from None
    if url not in self.urls:
      self.urls.append(url)
    self.down.discard(url)
    if self.router:
      router_lib.add_worker(self.router, url)
