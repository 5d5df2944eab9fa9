"""Our server's HTTP layer: SGLang's endpoints over the standard library's threading HTTP
server (one thread a connection; a trainer opens hundreds), each answering with SGLang's
status codes and shapes (protocol.py's errors: 400 {"error"}, 400 {"error": {"message"}}, a
500), SGLang's API and admin keys (Server.refuses), and `serve`, which starts one in this
process on a background thread. What a call does is the scheduler's.
"""

import http.server
import hmac
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from models import hf, host_allocator
from models.config import ModelConfig
from rollouts import sglang
from rollouts.server.protocol import (BadRequest, InternalError, Request, RequestError,
                                      SchedulerCrash, body_rids, context_error,
                                      derived_context_length, expand_request, memory_tags,
                                      response)
from rollouts.server.adapters import NOT_ENABLED, AdapterError, Adapters, lora_names
from rollouts.server.scheduler import Scheduler


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
           "/v1/loads": self.v1_loads, "/flush_cache": self.flush_cache,
           "/v1/models": self.v1_models}
    post = {"/generate": self.generate, "/abort_request": self.abort_request,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weight_version": self.update_weight_version,
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": self.release_memory_occupation,
            "/resume_memory_occupation": self.resume_memory_occupation,
            "/load_lora_adapter": self.load_lora_adapter,
            "/unload_lora_adapter": self.unload_lora_adapter}
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
                  "context_length": self.context_length, **self._lora_info(),
                  "internal_states": [s.loads()], "version": "0.5.23 (longrl embedded)"})

  def _lora_info(self) -> dict:
    """/server_info's LoRA settings: the start-up ones, never the adapters loaded since
    (SGLang's are its server args: server_args.py L316-333)."""
    a = self.scheduler.adapters
    return {"enable_lora": a is not None, "max_lora_rank": a and a.max_rank,
            "lora_target_modules": a and list(a.targets),
            "lora_paths": a.startup if a else None,
            "max_loaded_loras": a and a.max_loaded, "max_loras_per_batch": a.max_per_batch
            if a else 8, "lora_eviction_policy": "lru", "lora_backend": "csgmv"}

  def v1_models(self, h: Handler):
    """The served model's card, then one per adapter loaded now (http_server.py
    L1993-2023)."""
    created = int(time.time())
    card = lambda id_, root, parent: {"id": id_, "object": "model", "created": created,
                                      "owned_by": "sglang", "root": root, "parent": parent,
                                      "max_model_len": None}
    cards = [{**card(self.served_model_name, self.served_model_name, None),
              "max_model_len": self.context_length}]
    if self.scheduler.adapters is not None:
      cards += [card(name, path, self.served_model_name)
                for name, path in self.scheduler.adapters.loaded().items()]
    h._send(200, {"object": "list", "data": cards})

  def _lora_call(self, h: Handler, required: tuple[str, ...], call) -> None:
    """A LoRA load or unload answered as SGLang answers it: 200 with success true, 400 with
    success false and the message (both with the adapters then loaded; null when LoRA is
    off), FastAPI's 400 for a body without a required field (http_server.py L635-690,
    L1652-1684; io_struct.py L2572-2580)."""
    body = h._body()
    missing = [key for key in required if not isinstance(body.get(key), str)]
    if missing:
      h._send(400, {"object": "error", "message": f"Object missing required field `"
                    f"{missing[0]}`", "type": "Bad Request", "param": None, "code": 400})
      return
    adapters = self.scheduler.adapters
    reply = {"rid": None, "http_worker_ipc": None}
    if adapters is None:
      h._send(400, {**reply, "success": False, "error_message": NOT_ENABLED,
                    "loaded_adapters": None})
      return
    try:
      call(adapters, body)
    except AdapterError as e:
      h._send(400, {**reply, "success": False, "error_message": str(e),
                    "loaded_adapters": adapters.loaded()})
      return
    h._send(200, {**reply, "success": True, "error_message": "",
                  "loaded_adapters": adapters.loaded()})

  def load_lora_adapter(self, h: Handler):
    """{lora_name, lora_path, pinned}: Adapters.load over the weights served now."""
    self._lora_call(h, ("lora_name", "lora_path"), lambda adapters, body: adapters.load(
        body["lora_name"], body["lora_path"], bool(body.get("pinned", False)),
        self.scheduler.params))

  def unload_lora_adapter(self, h: Handler):
    """{lora_name}: Adapters.unload, which waits for the requests using it."""
    self._lora_call(h, ("lora_name",),
                    lambda adapters, body: adapters.unload(body["lora_name"]))

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
      self._name_adapters(body, requests)
      try:
        self.scheduler.submit(requests)
      except BaseException:
        for r in requests:
          if r.adapter is not None:
            self.scheduler.adapters.release(r.adapter)
        raise
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

  def _name_adapters(self, body: dict, requests: list[Request]) -> None:
    """Each request's LoRA adapter, from the body's lora_path (adapters.lora_names), counted
    in flight (Adapters.acquire); RequestError as SGLang's (tokenizer_manager.py
    L3723-3797)."""
    ids = body["input_ids"]  # expand_request checked it
    prompts = len(ids) if isinstance(ids[0], list) else 1
    names = lora_names(body, prompts, len(requests) // prompts)
    if not any(names):
      return
    adapters = self.scheduler.adapters
    if adapters is None:
      first = next(name for name in names if name)
      raise RequestError(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. "
                         "Please launch the server with --enable-lora flag and preload "
                         "adapters using --lora-paths or /load_lora_adapter endpoint.")
    for r, served in zip(requests, adapters.acquire(names, self.scheduler.params)):
      r.adapter = served

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
                 "rollouts/sglang_engine.py refusals has its lines)")
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
    self.scheduler.release_memory(memory_tags(h._body()))
    h._send(200, text="null")

  def resume_memory_occupation(self, h: Handler):
    """{"tags": [...]} or none (all): Scheduler.resume_memory (http_server.py L1587-1595)."""
    self.scheduler.resume_memory(memory_tags(h._body()))
    h._send(200, text="null")

  def update_weight_version(self, h: Handler):
    body = h._body()
    if body.get("abort_all_requests", True):
      self.scheduler.abort(None)
    with self.scheduler.lock:
      self.scheduler.weight_version = str(body.get("new_version"))
    h._send(200, {"success": True, "message": "Weight version updated.",
                  "new_version": self.scheduler.weight_version})



def serve(cfg: ModelConfig, params, *, host: str = "127.0.0.1", port: int = 0,
          warmup_len: int = 0, context_length: int | None = None, api_key: str | None = None,
          admin_api_key: str | None = None, lora: dict | None = None,
          lora_paths: dict[str, str] | None = None, **scheduler_options) -> Server:
  """A running server (on a background thread); `server.server_address` has the port.
  With warmup_len > 0, every batch shape for requests of up to that many tokens is compiled
  first (Scheduler.warmup). `context_length`: requests above it are refused as SGLang
  refuses them (context_error; default as SGLang derives it from the config.json the model
  has or would export: derived_context_length). `api_key`, `admin_api_key`: SGLang's
  --api-key and --admin-api-key (Server.refuses). `lora`: LoRA on (SGLang's --enable-lora),
  with Adapters' options (max_rank, targets, max_loaded, max_per_batch), and `lora_paths`
  {name: PEFT directory} loaded first (--lora-paths). `scheduler_options`: Scheduler's
  (weight_version, model_path, max_batch, deterministic, memory_saver and
  weights_cpu_backup for its release_memory, return_routed_experts: a mixture's routes are
  recorded for requests that ask)."""
  adapters = None if lora is None else Adapters(cfg, **lora)
  for name, path in (lora_paths or {}).items():
    adapters.load(name, path, False, params)
    adapters.startup.append({"lora_id": adapters.registry[name].lora_id, "lora_name": name,
                             "lora_path": path, "pinned": False})
  scheduler = Scheduler(cfg, params, adapters=adapters, **scheduler_options)
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
