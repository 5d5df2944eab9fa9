"""The continuous-batching scheduler of our server: waiting requests run in batches on a
background thread, one token per step (rollouts/decoding.py's prefill_logits and decode_step,
the loop on the host), so that abort, pause and weight updates take effect between tokens.
Owns the queues (waiting, running, and held: arrived while paused or updating), the prefix
cache of aborted requests' keys and values, pause modes (`retract` keeps the frozen batch's
KV instead of recomputing it), weight updates, memory release and SGLang's crash semantics
(SchedulerCrash). Batch shapes (rows, prompt width, cache length) come from short ladders so
that a server compiles few; `warmup` compiles all of them for requests up to a length before
serving. LONGRL_SERVER_DEBUG=1 logs each batch's size to stderr.

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

import base64
import dataclasses
import os
import sys
import threading
import time
import uuid
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import host_allocator, quantize, transformer, vision
from models.config import ModelConfig
from models.tokenizer import checkpoint_eos_ids
from rollouts.decoding import (bucket, decode_step, grow, prefill_logits, prompt_images,
                               request_keys, score_continuations, score_continuations_top_k,
                               shape_bucket)
from rollouts.server.protocol import (MEMORY_TAGS, Pending, Request, RequestError,
                                      SchedulerCrash)

GATHER_SECONDS = 0.01
PREFIX_CACHE_ENTRIES = 1024



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




def _prefix_key(r: Request, fed: int) -> tuple:
  """What the prefix cache keeps `r`'s input and first `fed` generated tokens under: the
  tokens, then its images' digests (the same ids with other images are another prefix; SGLang
  keys image tokens by their image's hash: schedule_batch.py
  MultimodalDataItem.pad_value), then its LoRA adapter's id (SGLang's extra_key:
  schedule_batch.py L1165-1170)."""
  adapter = () if r.adapter is None else (r.adapter.lora_id,)  # a version of its own
  return tuple(r.input_ids) + tuple(r.tokens[:fed]) + r.image_key + adapter


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
               return_routed_experts: bool = False, adapters=None):
    self.cfg, self.params = cfg, params
    self.adapters = adapters  # rollouts.server.adapters.Adapters with --enable-lora, or None
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
        weights = {id(r.adapter): self._weights(r) for r in scored}
      # By adapter; deterministic, each alone: its shapes (and top-k or not) then depend on
      # it only.
      by_adapter: dict = {}
      for r in scored:
        by_adapter.setdefault(id(r.adapter), []).append(r)
      for key, group in by_adapter.items():
        for part in ([[r] for r in group] if self.deterministic else [group]):
          self._score(weights[key], part)
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
        if self.adapters is not None:  # SGLang applies them to the new base
          self.adapters.rebase(params)
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

  def _weights(self, r: Request):
    """The params `r` is computed with: its adapter's merged weights, or the base's."""
    return self.params if r.adapter is None else r.adapter.weights

  def _finish(self, r: Request, reason: dict):
    if r.adapter is not None and not r.done.is_set():  # its adapter may now be unloaded
      self.adapters.release(r.adapter)
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
        if not batch:
          continue
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
    """The next batch, out of the waiting queue (call under the lock): the first max_batch
    requests of the oldest one's LoRA adapter (or the base: adapters are served merged, one
    a batch); deterministic, of those the ones laid out as the oldest one is. Empty when
    aborts emptied the queue while the batch gathered."""
    if not self.waiting:
      return []
    first = self.waiting[0]
    same = lambda r: r.adapter is first.adapter and (
        not self.deterministic or _layout(r) == _layout(first))
    if all(same(r) for r in self.waiting):
      batch, self.waiting = self.waiting[:self.max_batch], self.waiting[self.max_batch:]
      return batch
    batch = [r for r in self.waiting if same(r)][:self.max_batch]
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
    plen, 3] and their images when some prompt has images: prompt_images) and each row's
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
    made = prompt_images(self.cfg.vision, [r.input_ids for r in batch],
                         [r.images for r in batch], rows, plen)
    return prompts, lens, kv_valid, made.positions, made.images, made.next_positions

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
      params = self._weights(batch[0])
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
    keys = request_keys(jnp.asarray(seeds))
    temperature, top_p = jnp.asarray(temperature), jnp.asarray(top_p)
    active = np.zeros(rows, bool)
    active[:len(batch)] = True
    for i in range(max_new):
      with self.lock:
        while self.paused in ("in_place", "retract") and not any(r.aborted for r in batch):
          self.lock.wait(0.05)  # frozen: the KV stays, weights may change meanwhile
        params, version = self._weights(batch[0]), self.weight_version
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
        cache, kv_valid = grow(cache, kv_valid, grown - size)
        size = grown
      token, logp, logits, cache, kv_valid, routes = decode_step(
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
      logits, cache, routes = prefill_logits(
          params, jnp.asarray(prompts), jnp.asarray(positions), jnp.asarray(kv_valid[:, :plen]),
          transformer.init_cache(self.cfg, rows, plen), images, cfg=self.cfg)
      return logits, grow(cache, kv_valid[:, :plen], size - plen)[0], routes
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
        images = prompt_images(self.cfg.vision,
                               [batch[i].input_ids if i < len(batch) else None for i in pick],
                               [batch[i].images if i < len(batch) else [] for i in pick], rows,
                               width).images
      part_logits, part, part_routes = prefill_logits(
          params, jnp.asarray(prompts[pick, cols]), jnp.asarray(positions[pick, cols]),
          jnp.asarray(kv_valid[pick, cols]), transformer.init_cache(self.cfg, rows, width),
          images, cfg=self.cfg)
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

