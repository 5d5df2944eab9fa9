"""The agent endpoint: an OpenAI-compatible HTTP server in front of any rollout engine, so
that an agent written only against an OpenAI SDK can be trained; every call is recorded in its
session (sessions.py) with the exact tokens the engine sampled.

Serves /v1/models, /v1/chat/completions (the checkpoint's chat template, tools, tool calls in
OpenAI's shape, reasoning_content, stop, n, logprobs, streaming) and /v1/completions (a text
or token-id prompt). Each episode opens a session with a key of its own: the agent passes it
as its API key (`Authorization: Bearer KEY`, which any SDK sends) or uses the session's base
URL (`/sessions/KEY/v1`). Streaming is synthesised from the finished generation, so no token
id is lost between engine and record. The run's sampling settings win over the agent's
(temperature, top_p, seed; each override is counted in the session and logged once); an
agent's max_tokens is honoured up to the run's. An SDK's retry (x-stainless-retry-count > 0)
of a body already sent replays that call's response instead of sampling again; a reply whose
client left before it was sent (and that no retry fetched) is in no branch. Bodies are
capped (413), every wait is bounded (504), calls while the engine takes new weights wait
(or get 429 with Retry-After: Limits.retry_after_s).

Engine calls go through `EngineQueue`: whatever calls wait when the engine is free go to it
as one batch (the engine's on_ready answers each as it finishes), one batch at a time; to
servers, which batch continuously, each call goes as it arrives.
It owns no training: the loop turns a session's branches into trajectories.
"""

import concurrent.futures
import dataclasses
import http.server
import json
import logging
import secrets
import select
import socket
import threading
import time
import numpy as np

from models.tokenizer import ChatPrompts
from rl.agents import chat as chatlib
from rl.agents.sessions import Plan, Reasoning, Session, SessionClosed
from rollouts.engine import Completion, SamplingParams

log = logging.getLogger(__name__)


class EngineQueue:
  """One engine, many callers. `submit` queues a prompt; a worker thread hands the prompts
  waiting when the engine is free to one engine.generate, one batch at a time, or, for
  servers (Capabilities.serves_all_processes: they batch continuously themselves), each
  prompt to a generate of its own as it arrives, so that no call waits for another's end.
  `hold` (and `update_weights`) waits for what is in flight and keeps the rest waiting."""

  def __init__(self, engine, sampling: SamplingParams, *, seed: int = 0):
    self._engine = engine
    self._sampling = sampling
    self._seed = seed
    self._batches = 0
    self._cond = threading.Condition()
    self._waiting: list[tuple[np.ndarray, int, int, concurrent.futures.Future]] = []
    self._holds = 0  # hold() calls not yet released: calls go to the engine at 0
    self._in_flight = 0  # generate calls running
    self._closed = False
    self._each = (concurrent.futures.ThreadPoolExecutor(256, "agent-endpoint-call")
                  if engine.capabilities.serves_all_processes else None)
    self._thread = threading.Thread(target=self._run, name="agent-endpoint-engine", daemon=True)
    self._thread.start()

  def submit(self, prompt_ids: np.ndarray, max_new_tokens: int,
             affinity: int) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    with self._cond:
      if self._closed:
        raise RuntimeError("the agent endpoint is closed")
      self._waiting.append((prompt_ids, max_new_tokens, affinity, future))
      self._cond.notify_all()
    return future

  def _run(self):
    while True:
      with self._cond:
        self._cond.wait_for(lambda: self._closed or (self._waiting and not self._holds
                                                      and (self._each or not self._in_flight)))
        if self._closed:
          return
        batch, self._waiting = self._waiting, []
        batches = [[item] for item in batch] if self._each else [batch]
        seeds = range(self._seed + self._batches, self._seed + self._batches + len(batches))
        self._batches += len(batches)
        self._in_flight += len(batches)
      for one, seed in zip(batches, seeds):
        if self._each:
          self._each.submit(self._dispatch, one, seed)
        else:
          self._dispatch(one, seed)

  def _dispatch(self, batch, seed: int):
    try:
      self._generate(batch, seed)
    finally:
      with self._cond:
        self._in_flight -= 1
        self._cond.notify_all()

  def _generate(self, batch, seed: int):
    futures = [item[3] for item in batch]

    def ready(done: dict[int, Completion]):
      for i, completion in done.items():
        if not futures[i].done():
          futures[i].set_result(completion)
    try:
      completions = self._engine.generate(
          [item[0].tolist() for item in batch], self._sampling, seed=seed,
          affinity=[item[2] for item in batch], max_new_tokens=[item[1] for item in batch],
          on_ready=ready)
      ready(dict(enumerate(completions)))
    except Exception as e:  # every caller of the batch gets the engine's error
      for future in futures:
        if not future.done():
          future.set_exception(e)

  def hold(self) -> "Held":
    """Holds the queue once the batch in flight is done: calls made meanwhile wait (bounded
    by their timeout) until every hold is released."""
    with self._cond:
      self._holds += 1
      self._cond.wait_for(lambda: not self._in_flight)
    return Held(self)

  @property
  def held(self) -> bool:
    with self._cond:
      return self._holds > 0

  def _release(self):
    with self._cond:
      self._holds -= 1
      self._cond.notify_all()

  def update_weights(self, params, version: int) -> float:
    """The engine's update_weights, between batches; calls made meanwhile wait."""
    held = self.hold()
    try:
      return self._engine.update_weights(params, version)
    finally:
      held.release()

  def close(self):
    with self._cond:
      self._closed = True
      waiting, self._waiting = self._waiting, []
      self._cond.notify_all()
    for item in waiting:
      item[3].set_exception(RuntimeError("the agent endpoint closed before this call ran"))
    self._thread.join(timeout=60)
    if self._each is not None:
      self._each.shutdown(wait=False, cancel_futures=True)


class Held:
  """The hold EngineQueue.hold() took; `release()` (idempotent) lets the calls go."""

  def __init__(self, queue: EngineQueue):
    self._queue, self._released = queue, False

  def release(self):
    if not self._released:
      self._released = True
      self._queue._release()


class HTTPError(Exception):
  """An error answered in OpenAI's shape: {"error": {"message", "type", "code"}}."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.kind, self.headers = status, kind, dict(headers or {})


@dataclasses.dataclass(frozen=True)
class Limits:
  """max_body_bytes: a larger request is refused (413; tool outputs can be large);
  call_timeout_s: the longest a call waits for the engine (504); max_n: the most choices
  one call may ask for; retry_after_s: while the engine takes new weights a call waits
  (None), or is answered 429 with this Retry-After (an SDK retries it, as OpenAI's do)."""
  max_body_bytes: int = 64 << 20
  call_timeout_s: float = 600.0
  max_n: int = 16
  retry_after_s: float | None = None


class AgentEndpoint:
  """The endpoint over `engine`, rendering with `chat` (an HF checkpoint's ChatPrompts),
  sampling with the run's `sampling` (its max_new_tokens the most a call gets; its stop
  tokens the chat's when it names none). `start()` serves on host:port (0: a free port);
  `open_session()` gives each episode its key and base URL; `close_session` ends one and
  returns it (its calls, drift counts and branches)."""

  def __init__(self, engine, chat: ChatPrompts, sampling: SamplingParams, *,
               model_name: str = "longrl", reasoning: Reasoning = "keep", seed: int = 0,
               limits: Limits = Limits(), host: str = "127.0.0.1", port: int = 0):
    if not chat.tokenizer.chat_template:
      raise ValueError("the agent endpoint needs a checkpoint with a chat template")
    if not sampling.stop_token_ids:
      sampling = dataclasses.replace(sampling, stop_token_ids=chat.stop_token_ids)
    self.chat, self.sampling, self.model_name = chat, sampling, model_name
    self.reasoning, self.limits = reasoning, limits
    self.context_length = engine.capabilities.context_length
    self.queue = EngineQueue(engine, sampling, seed=seed)
    self._sessions: dict[str, Session] = {}
    self._lock = threading.Lock()
    self._warned: set[str] = set()
    self._server = _Server((host, port), _Handler, self)
    self._thread = None

  @property
  def url(self) -> str:
    """The base URL an OpenAI client takes (`OpenAI(base_url=url, api_key=session.key)`)."""
    host, port = self._server.server_address[:2]
    return f"http://{host}:{port}/v1"

  def start(self) -> "AgentEndpoint":
    self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint",
                                    daemon=True)
    self._thread.start()
    return self

  def open_session(self, metadata: dict | None = None) -> Session:
    session = Session("sk-longrl-" + secrets.token_hex(16), self.chat, reasoning=self.reasoning,
                      metadata=metadata)
    with self._lock:
      self._sessions[session.key] = session
    return session

  def session_url(self, session: Session) -> str:
    """A base URL that is the session (for a harness whose API key is fixed)."""
    return self.url.removesuffix("/v1") + f"/sessions/{session.key}/v1"

  def close_session(self, session: Session) -> Session:
    session.close()
    with self._lock:
      self._sessions.pop(session.key, None)
    return session

  def session(self, key: str) -> Session:
    with self._lock:
      found = self._sessions.get(key)
    if found is None:
      raise HTTPError(401, "unknown or ended session key", "authentication_error")
    return found

  def update_weights(self, params, version: int) -> float:
    return self.queue.update_weights(params, version)

  def close(self):
    if self._thread is not None:  # shutdown() waits for a serve_forever that never ran
      self._server.shutdown()
      self._thread.join(timeout=60)
    self._server.server_close()
    self.queue.close()

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.close()

  # What a call does (the handler only moves bytes).

  def overrides(self, session: Session, body: dict) -> None:
    """Counts (and logs once) each sampling setting of the agent's that the run's replaces."""
    run = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
    for name, value in body.items():
      if name in ("seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
                  "min_p", "repetition_penalty") or (name in run and value is not None
                                                      and float(value) != run[name]):
        session.overrides[name] += 1
        if name not in self._warned:
          self._warned.add(name)
          log.warning("agent endpoint: the agent's %s=%r is replaced by the run's sampling "
                      "(%s)", name, value, run.get(name, "not applied"))

  def sample(self, session: Session, plan: Plan, body: dict, n: int) -> list[Completion]:
    """n completions of the plan's prompt, each cut at the first of the body's stop strings."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = self.sampling.max_new_tokens if limit is None else min(int(limit),
                                                                    self.sampling.max_new_tokens)
    if self.context_length is not None:
      budget = min(budget, self.context_length - len(plan.prompt_ids))
    if budget < 1:
      raise HTTPError(400, f"the prompt holds {len(plan.prompt_ids)} tokens: no room to "
                      f"generate within the context length {self.context_length}")
    if self.limits.retry_after_s is not None and self.queue.held:
      raise HTTPError(429, "the engine is taking new weights; retry after "
                      f"{self.limits.retry_after_s} s", "rate_limit_error",
                      {"Retry-After": f"{self.limits.retry_after_s:g}"})
    affinity = int.from_bytes(session.key.encode()[-8:], "little")
    futures = [self.queue.submit(plan.prompt_ids, budget, affinity) for _ in range(n)]
    try:
      done = [f.result(timeout=self.limits.call_timeout_s) for f in futures]
    except concurrent.futures.TimeoutError:
      raise HTTPError(504, f"the engine did not answer within {self.limits.call_timeout_s} s",
                      "timeout") from None
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    return [self._cut(c, stops) for c in done]

  def _cut(self, completion: Completion, stops: list[str]) -> Completion:
    """The completion up to the token that completes its first stop string (OpenAI's stop);
    the tokens sampled after it are dropped, as if generation had stopped there."""
    text = self.decode(completion.token_ids)
    if not stops or chatlib.stop_at(text, stops) is None:
      return completion
    low, high = 1, len(completion.token_ids)
    while low < high:  # the shortest prefix whose text holds a stop string
      mid = (low + high) // 2
      if chatlib.stop_at(self.decode(completion.token_ids[:mid]), stops) is None:
        low = mid + 1
      else:
        high = mid
    return dataclasses.replace(completion.cut(low), finish_reason="stop")

  def decode(self, ids) -> str:
    return self.chat.tokenizer.decode(ids, skip_special_tokens=True)

  def chat_completion(self, session: Session, body: dict) -> dict:
    messages = chatlib.template_messages(body.get("messages"))
    tools = body.get("tools") or None
    n = _count(body, self.limits.max_n)
    self.overrides(session, body)
    plan = session.plan_chat(messages, tools)
    choices = []
    completions = self.sample(session, plan, body, n)
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    for i, completion in enumerate(completions):
      text = self.decode(completion.token_ids)
      at = chatlib.stop_at(text, stops)
      message, reason = chatlib.reply_message(text if at is None else text[:at],
                                              completion.finish_reason,
                                              tools_offered=bool(tools))
      index = session.record(plan, completion, messages=messages,
                             reply=chatlib.given_reply(message))
      choice = {"index": i, "message": message, "finish_reason": reason,
                "logprobs": self._logprobs(completion) if body.get("logprobs") else None}
      self._token_fields(choice, body, plan, completion, index)
      choices.append(choice)
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or self.model_name,
            "choices": choices, "usage": _usage(plan, completions)}

  def text_completion(self, session: Session, body: dict) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and 0 <= t < self.chat.vocab_size for t in prompt)):
      raise HTTPError(400, "prompt must be a non-empty string or list of token ids in "
                      f"[0, {self.chat.vocab_size}) (one prompt per call)")
    n = _count(body, self.limits.max_n)
    self.overrides(session, body)
    plan = session.plan_text(prompt)
    completions = self.sample(session, plan, body, n)
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    prompt_text = prompt if isinstance(prompt, str) else self.decode(prompt)
    choices = []
    for i, completion in enumerate(completions):
      text = self.decode(completion.token_ids)
      at = chatlib.stop_at(text, stops)
      text = text if at is None else text[:at]
      index = session.record(plan, completion, text=prompt_text + text)
      choice = {"index": i, "text": text, "finish_reason": completion.finish_reason,
                "logprobs": None}
      self._token_fields(choice, body, plan, completion, index)
      choices.append(choice)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
            "created": int(time.time()), "model": body.get("model") or self.model_name,
            "choices": choices, "usage": _usage(plan, completions)}

  def _logprobs(self, completion: Completion) -> dict:
    content = []
    for token, logprob in zip(completion.token_ids.tolist(), completion.logprobs.tolist()):
      text = self.chat.tokenizer.decode([token])
      content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                      "top_logprobs": []})
    return {"content": content}

  @staticmethod
  def _token_fields(choice: dict, body: dict, plan: Plan, completion: Completion, call: int):
    """SGLang's token fields where asked (return_prompt_token_ids, return_token_ids:
    entrypoints/openai/protocol.py L1318-1330), and the call's place in its session."""
    if body.get("return_prompt_token_ids"):
      choice["prompt_token_ids"] = plan.prompt_ids.tolist()
    if body.get("return_token_ids"):
      choice["response_token_ids"] = completion.token_ids.tolist()
    choice["longrl"] = {"call": call, "drift": plan.drift,
                        "weight_versions": sorted(set(completion.versions.tolist()))}


def _count(body: dict, most: int) -> int:
  n = body.get("n", 1)
  if n is None:
    return 1
  if not isinstance(n, int) or not 1 <= n <= most:
    raise HTTPError(400, f"n must be an integer in [1, {most}], got {n!r}")
  return n


def _usage(plan: Plan, completions: list[Completion]) -> dict:
  generated = sum(len(c.token_ids) for c in completions)
  return {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": generated,
          "total_tokens": len(plan.prompt_ids) + generated}


def _chunks(response: dict) -> list[dict]:
  """A finished response as the chunks a stream would have sent: each choice's role, then its
  reasoning, content and tool calls whole, then its finish; the usage last."""
  chat = response["object"] == "chat.completion"
  head = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
          "created": response["created"], "model": response["model"]}
  chunks = []
  for choice in response["choices"]:
    index = choice["index"]
    if not chat:
      chunks.append({**head, "choices": [{"index": index, "text": choice["text"],
                                          "finish_reason": None, "logprobs": None}]})
    else:
      message = choice["message"]
      deltas = [{"role": "assistant", "content": ""}]
      if message.get("reasoning_content"):
        deltas.append({"reasoning_content": message["reasoning_content"]})
      if message["content"]:
        deltas.append({"content": message["content"]})
      if message.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": k, **call}
                                      for k, call in enumerate(message["tool_calls"])]})
      chunks += [{**head, "choices": [{"index": index, "delta": d, "finish_reason": None,
                                       "logprobs": None}]} for d in deltas]
    last = {"index": index, "finish_reason": choice["finish_reason"], "logprobs": None,
            "longrl": choice["longrl"]}
    last.update({"delta": {}} if chat else {"text": ""})
    chunks.append({**head, "choices": [last]})
  return chunks


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 1024  # the listen backlog: hundreds of agents connect at once (5 drops them)

  def __init__(self, address, handler, endpoint: AgentEndpoint):
    self.endpoint = endpoint
    super().__init__(address, handler)


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: _Server

  def log_message(self, *args):  # quiet: agents make thousands of calls
    pass

  def setup(self):
    super().setup()
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

  def _route(self) -> tuple[str | None, str]:
    """(the key in the path, the API path) of /sessions/KEY/v1/... or /v1/..."""
    path = self.path.split("?", 1)[0]
    if path.startswith("/sessions/"):
      key, _, rest = path[len("/sessions/"):].partition("/")
      return key, "/" + rest
    return None, path

  def _session(self, key: str | None) -> Session:
    if key is None:
      auth = self.headers.get("Authorization", "")
      key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
    return self.server.endpoint.session(key)

  def _send_json(self, status: int, value: dict, headers: dict | None = None):
    payload = json.dumps(value).encode()
    self.send_response(status)
    for name, header in (headers or {}).items():
      self.send_header(name, header)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(payload)))
    self.end_headers()
    self.wfile.write(payload)

  def _send_error(self, e: HTTPError):
    self._send_json(e.status, {"error": {"message": str(e), "type": e.kind, "param": None,
                                         "code": e.status}}, e.headers)

  def _send_stream(self, response: dict, body: dict):
    """Server-sent events in chunked transfer encoding, ending with [DONE]."""
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()
    events = _chunks(response)
    if (body.get("stream_options") or {}).get("include_usage"):
      events.append({**{k: response[k] for k in ("id", "created", "model")},
                     "object": events[0]["object"], "choices": [], "usage": response["usage"]})
    for data in [json.dumps(e) for e in events] + ["[DONE]"]:
      frame = f"data: {data}\n\n".encode()
      self.wfile.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")
    self.wfile.write(b"0\r\n\r\n")

  def do_GET(self):
    try:
      key, path = self._route()
      self._session(key)
      if path != "/v1/models":
        raise HTTPError(404, f"no such endpoint: GET {path}")
      endpoint = self.server.endpoint
      self._send_json(200, {"object": "list", "data": [
          {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "longrl"}]})
    except HTTPError as e:
      self._send_error(e)

  def do_POST(self):
    try:
      self._post()
    except HTTPError as e:
      self._send_error(e)
    except (chatlib.ChatError, ValueError) as e:
      self._send_error(HTTPError(400, str(e)))
    except SessionClosed as e:
      self._send_error(HTTPError(409, str(e)))
    except (BrokenPipeError, ConnectionResetError):
      pass  # the client left; its call is recorded, its answer has nowhere to go
    except Exception as e:  # noqa: BLE001 - answered, not raised into the server's thread
      log.exception("agent endpoint: a call failed")
      self._send_error(HTTPError(500, f"{type(e).__name__}: {e}", "server_error"))

  def _post(self):
    key, path = self._route()
    endpoint = self.server.endpoint
    handlers = {"/v1/chat/completions": endpoint.chat_completion,
                "/v1/completions": endpoint.text_completion}
    if path not in handlers:
      raise HTTPError(404, f"no such endpoint: POST {path}")
    session = self._session(key)
    size = int(self.headers.get("Content-Length") or 0)
    if size > endpoint.limits.max_body_bytes:
      raise HTTPError(413, f"the body holds {size} bytes; the endpoint takes at most "
                      f"{endpoint.limits.max_body_bytes} (Limits.max_body_bytes)")
    raw = self.rfile.read(size)
    try:
      body = json.loads(raw or b"{}")
    except json.JSONDecodeError as e:
      raise HTTPError(400, f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
      raise HTTPError(400, "the request body must be a JSON object")
    retry = (self.headers.get("x-stainless-retry-count") or "0").strip() not in ("", "0")
    done, answer, first = session.answer_slot(path.encode() + raw, retry)
    if not first:
      if not done.wait(endpoint.limits.call_timeout_s) or not answer:
        raise HTTPError(504, "the call this retry repeats has not been answered", "timeout")
    else:
      try:
        answer.append(handlers[path](session, body))
      finally:
        done.set()
    if self._client_gone():  # a client that timed out: its reply reached nobody
      return
    if body.get("stream"):
      self._send_stream(answer[0], body)
    else:
      self._send_json(200, answer[0])
    session.delivered(choice["longrl"]["call"] for choice in answer[0]["choices"])

  def _client_gone(self) -> bool:
    """Whether the client closed its connection (an end of stream waits to be read)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
    except OSError:
      return True

