"""The SGLang client against a real server process on 127.0.0.1 (rollouts/server/), and
both against SGLang's own generated JSON contract (sglang/api/v1/api_types.py from the pinned
sglang 0.5.23 wheel, fetched with pip download and cached; it needs only msgspec)."""

import http.server
import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config, hf, transformer
from rl import batch as batch_lib
from rl import corrections, envs, loop, replay, rollout, sampling, sources, trainer
from rl.config import RLConfig
from rl.envs import driver
from rl.tasks.arithmetic import Arithmetic
from rl.checkpoint import Checkpointer
from rl.packing import trajectory_batch
from rl.train_step import policy_logprobs
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from rollouts.server.main import launch
from tests import helpers
from rollouts.sglang import Request, SGLangClient, ServerError, parse_response, request_body
from rollouts.sglang_engine import SGLangEngine, remote_engine

SGLANG = "0.5.23"
REFERENCE_RESPONSE = {  # ../shared/reference/sglang.md section 1.2
    "text": " 4", "output_ids": [220, 19, 151645],
    "meta_info": {"id": "traj-00042-seg1", "finish_reason": {"type": "stop", "matched": 151645},
                  "prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 0,
                  "reasoning_tokens": 0, "num_retractions": 0, "weight_version": "7",
                  "weight_versions": [{"version": "7", "start": 0, "end": 3}],
                  "input_token_logprobs": [],
                  "output_token_logprobs": [[-0.0121, 220, None], [-0.2034, 19, None],
                                            [-0.0003, 151645, None]],
                  "output_token_logprobs_length": 3, "e2e_latency": 0.042}}
REFERENCE_REQUEST_KEYS = {"rid", "input_ids", "sampling_params", "return_logprob",
                          "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                          "stream"}
REFERENCE_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                           "stop_token_ids", "skip_special_tokens", "no_stop_trim", "n"}
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
# The checkpoints are float32, which a server (as SGLang) serves in float16 unless told.
F32 = ("--dtype", "float32")


@pytest.fixture(scope="session")
def api_types():
  """SGLang's generated contract module, loaded by file path from the pinned wheel."""
  cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
  path = cache / "longrl" / f"sglang-{SGLANG}" / "api_types.py"
  if not path.exists():
    with tempfile.TemporaryDirectory() as tmp:
      got = subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG}",
                            "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                            "-d", tmp, "-q"], capture_output=True, text=True, timeout=600)
      assert got.returncode == 0, f"pip download sglang=={SGLANG} failed: {got.stderr[-2000:]}"
      wheel = next(pathlib.Path(tmp).glob("sglang-*.whl"))
      path.parent.mkdir(parents=True, exist_ok=True)
      with zipfile.ZipFile(wheel) as z:
        path.write_bytes(z.read("sglang/api/v1/api_types.py"))
  spec = importlib.util.spec_from_file_location("sglang_api_types", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def model(tokenizer, tmp_path_factory):
  """A tiny Qwen2 checkpoint on disk (v0) and a second set of weights (v1)."""
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=64)
  root = tmp_path_factory.mktemp("weights")
  params = [transformer.init_params(cfg, jax.random.PRNGKey(seed)) for seed in (0, 1)]
  paths = [hf.save(p, cfg, str(root / f"v{i:06d}")) for i, p in enumerate(params)]
  return cfg, params, paths, str(root)


@pytest.fixture(scope="module")
def servers(model):
  """Two server processes serving v0."""
  _, _, paths, _ = model
  started = [launch(["--hf_checkpoint", paths[0], "--weight_version", "0", *F32])
             for _ in range(2)]
  yield [url for _, url in started], [process for process, _ in started]
  for process, _ in started:
    process.kill()
    process.wait()


def greedy(max_new, stop=()):
  return SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stop)


PROMPTS = [[3, 17, 22, 9], [40, 41], [5] * 9]  # ids < the tiny vocabulary (55)


# --- the contract


def test_requests_validate_against_sglangs_contract(api_types):
  body = request_body(Request("traj-1-seg0", (1, 2, 3), 64, sampling_seed=7),
                      SamplingParams(64, temperature=0.7, top_p=0.9, stop_token_ids=(2,)))
  api_types.GenerateRequest.from_json_value(body)
  api_types.SamplingParams.from_json_value(body["sampling_params"])  # unknown keys rejected
  assert set(body) == REFERENCE_REQUEST_KEYS
  assert set(body["sampling_params"]) - {"sampling_seed"} == REFERENCE_SAMPLING_KEYS
  with pytest.raises(api_types.JsonContractError):  # the strictness we rely on
    api_types.SamplingParams.from_json_value({**body["sampling_params"], "max_tokens": 5})
  api_types.AbortRequest.from_json_value({"rid": "traj-1"})
  api_types.AbortRequest.from_json_value({"abort_all": True})


def test_reference_response_parses(api_types):
  api_types.GenerateResponse.from_json_value(REFERENCE_RESPONSE)
  completion = parse_response("golden", REFERENCE_RESPONSE)
  assert completion.token_ids.tolist() == [220, 19, 151645]
  np.testing.assert_allclose(completion.logprobs, [-0.0121, -0.2034, -0.0003], rtol=1e-6)
  assert completion.finish_reason == "stop" and completion.versions.tolist() == [7, 7, 7]


def test_server_responses_validate_against_sglangs_contract(api_types, servers):
  urls, _ = servers
  http = httpx.Client(timeout=60)
  body = request_body(Request("c-1", tuple(PROMPTS[0]), 6), greedy(6))
  single = http.post(urls[0] + "/generate", json=body).json()
  api_types.GenerateResponse.from_json_value(single)
  batch = http.post(urls[0] + "/generate", json={**body, "rid": ["b-1", "b-2"],
                                                 "input_ids": PROMPTS[:2]}).json()
  assert [r["meta_info"]["id"] for r in batch] == ["b-1", "b-2"]
  for r in batch:
    api_types.GenerateResponse.from_json_value(r)
  n2 = http.post(urls[0] + "/generate", json={**body, "sampling_params": {
      **body["sampling_params"], "n": 2}}).json()
  assert len(n2) == 2 and n2[0]["meta_info"]["id"] != "c-1"  # n > 1: fresh rids, as SGLang
  stream = http.post(urls[0] + "/generate", json={**body, "stream": True}).text
  chunks = [json.loads(line[6:]) for line in stream.split("\n\n") if line.startswith("data: {")]
  assert stream.rstrip().endswith("data: [DONE]")
  assert chunks[-1]["output_ids"] == single["output_ids"]  # cumulative chunks
  for chunk in chunks:
    api_types.GenerateResponse.from_json_value(chunk)
  api_types.GetModelInfoResponse.from_json_value(http.get(urls[0] + "/model_info").json())
  scored = http.post(urls[0] + "/generate", json={  # teacher scoring with its top-k
      **body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 0},
      "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}).json()
  api_types.GenerateResponse.from_json_value(scored)
  top = scored["meta_info"]["input_top_logprobs"]
  assert len(top) == len(PROMPTS[0]) and top[0] is None and all(len(r) == 2 for r in top[1:])
  bad = http.post(urls[0] + "/generate", json={**body, "sampling_params": {"max_tokens": 3}})
  assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]
  api_types.ErrorBody.from_json_value({"message": bad.json()["error"]})


# --- the client against server processes


def test_generate_and_logprobs_equal_the_in_process_engine(model, servers):
  cfg, params, _, _ = model
  urls, _ = servers
  client = SGLangClient(urls)
  client.check_health()
  engine = SGLangEngine(client, cfg, weights_dir="unused")
  local = JaxEngine(cfg, params[0])
  sampling = greedy(24, stop=(1,))
  remote = engine.generate(PROMPTS, sampling, seed=0)
  for r, l in zip(remote, local.generate(PROMPTS, sampling, seed=0)):
    assert r.token_ids.tolist() == l.token_ids.tolist()
    np.testing.assert_allclose(r.logprobs, l.logprobs, atol=1e-5)
    assert r.finish_reason == l.finish_reason and set(r.versions.tolist()) == {0}
  # Sampled at temperature 1, the server's log-probs are the trainer's on the same tokens.
  sampled = engine.generate(PROMPTS * 2, SamplingParams(24, temperature=1.0), seed=3)
  batch, _ = trajectory_batch(PROMPTS * 2, [c.token_ids for c in sampled],
                              [c.logprobs for c in sampled], [0.0] * 6, [True] * 6, 64)
  trainer = np.asarray(jax.jit(policy_logprobs, static_argnums=1)(
      params[0], cfg, jax.tree.map(jnp.asarray, batch))[0])
  mask = batch.loss_mask > 0
  assert np.abs(trainer - batch.old_logp)[mask].max() < 1e-5


def test_weight_update_changes_outputs_and_version(model, servers):
  cfg, params, paths, _ = model
  urls, _ = servers
  client = SGLangClient(urls)
  before = client.generate([Request(f"w-{i}", tuple(p), 16) for i, p in enumerate(PROMPTS)],
                           greedy(16))
  seconds = client.sync_weights(paths[1], 1)
  assert seconds > 0
  assert {info["weight_version"] for info in client.model_info().values()} == {"1"}
  after = client.generate([Request(f"w2-{i}", tuple(p), 16) for i, p in enumerate(PROMPTS)],
                          greedy(16))
  expected = JaxEngine(cfg, params[1]).generate(PROMPTS, greedy(16), seed=0)
  assert [a.token_ids.tolist() for a in after] == [e.token_ids.tolist() for e in expected]
  assert [a.token_ids.tolist() for a in after] != [b.token_ids.tolist() for b in before]
  assert all(set(a.versions.tolist()) == {1} for a in after)
  failed = httpx.post(urls[0] + "/update_weights_from_disk",
                      json={"model_path": "/nonexistent", "weight_version": "9"}, timeout=60)
  assert failed.status_code == 400 and failed.json()["success"] is False
  client.sync_weights(paths[0], 0)  # back to v0 for the other tests
  assert httpx.post(urls[0] + "/pause_generation", json={"mode": "abort"}).json() == PAUSED
  assert httpx.post(urls[0] + "/continue_generation", json={}).json() == CONTINUED


def _generate_in_background(client, requests, sampling):
  out = {}

  def run():
    try:
      out["result"] = client.generate(requests, sampling)
    except ServerError as e:
      out["error"] = e

  thread = threading.Thread(target=run)
  thread.start()
  return thread, out


def _wait_for_tokens(url, at_least, thread):
  """True once the server holds at least `at_least` tokens of running requests; False when
  `thread` (the client's) ends first. Polled over one kept-alive connection: a new one per
  poll costs ~30 ms here, and a 160-token request takes ~130 ms."""
  deadline = time.monotonic() + 120
  with httpx.Client(base_url=url) as http:
    while thread.is_alive() and time.monotonic() < deadline:
      loads = http.get("/v1/loads").json()["loads"][0]
      if loads["num_running_reqs"] and loads["num_used_tokens"] >= at_least:
        return True
      time.sleep(0.001)
  if thread.is_alive():
    raise TimeoutError(f"{url} generated nothing in 120 s")
  return False


def _freeze_a_busy_server(urls, thread) -> int | None:
  """The index of one of `urls` seen running requests while `thread` (the client's) runs,
  then paused in place with requests still running (frozen, as SGLang's in_place pause
  keeps them); None when the thread ends first."""
  deadline = time.monotonic() + 120
  clients = [httpx.Client(base_url=url) for url in urls]
  running = lambda http: http.get("/v1/loads").json()["loads"][0]["num_running_reqs"]
  try:
    while thread.is_alive() and time.monotonic() < deadline:
      for i, http in enumerate(clients):
        if running(http):
          http.post("/pause_generation", json={"mode": "in_place"})
          if running(http):
            return i
          http.post("/continue_generation", json={})  # it finished them first
      time.sleep(0.001)
  finally:
    for http in clients:
      http.close()
  if thread.is_alive():
    raise TimeoutError(f"no server of {urls} ran anything in 120 s")
  return None


def test_abort_returns_partial_output_and_resume_equals_uninterrupted(model, servers):
  urls, _ = servers
  client = SGLangClient(urls[:1])
  prompt = tuple(PROMPTS[0])
  sampling = greedy(160)
  whole = client.generate([Request("whole", prompt, 160)], sampling)[0]
  for attempt in range(5):  # on a busy machine the request may end before a poll sees it
    thread, out = _generate_in_background(client, [Request(f"cut-1.{attempt}", prompt, 160)],
                                          sampling)
    if _wait_for_tokens(urls[0], len(prompt) + 10, thread):
      client.abort_all()
    thread.join()
    first = out["result"][0]
    if first.finish_reason == "abort":
      break
  assert first.finish_reason == "abort" and 0 < len(first.token_ids) < 160
  assert len(first.logprobs) == len(first.versions) == len(first.token_ids)
  # Resumed twice: first from the server's copy of the aborted request's keys and values
  # (reported as cached_tokens, as SGLang's radix cache does), then, after /flush_cache,
  # recomputed. Both continue exactly as the uninterrupted request did.
  resumed = Request("cut-2", prompt + tuple(first.token_ids.tolist()),
                    160 - len(first.token_ids))
  for rid, cached_tokens in (("cut-2", len(resumed.input_ids)), ("cut-3", 0)):
    answer = httpx.post(f"{urls[0]}/generate", timeout=120, json=request_body(
        Request(rid, resumed.input_ids, resumed.max_new_tokens), sampling)).json()
    assert answer.get("meta_info", {}).get("cached_tokens") == cached_tokens, answer
    rest = parse_response(urls[0], answer)
    joined = np.concatenate([first.token_ids, rest.token_ids])
    assert joined.tolist() == whole.token_ids.tolist()
    np.testing.assert_allclose(np.concatenate([first.logprobs, rest.logprobs]),
                               whole.logprobs, atol=1e-5)
    assert httpx.post(f"{urls[0]}/flush_cache", timeout=30).status_code == 200


def test_prefix_cache_holds_aborted_requests_until_the_weights_change(model):
  """In process: an aborted request's keys and values are kept under its whole token
  sequence, and a weight update drops them (they belong to the old weights)."""
  from rollouts.server.protocol import Request as ServerRequest
  from rollouts.server.scheduler import Scheduler
  cfg, params, _, _ = model
  scheduler = Scheduler(cfg, params[0], weight_version="0")
  try:
    r = ServerRequest(rid="p-1", input_ids=[3, 17, 22], max_new_tokens=400, temperature=0.0,
                      top_p=1.0, stop_token_ids=(), seed=0, return_logprob=False)
    scheduler.submit([r])
    with scheduler.lock:  # woken after each token: a polling loop could miss all 400
      assert scheduler.lock.wait_for(lambda: len(r.tokens) >= 5, 120)
      scheduler.abort("p-")
    assert r.done.wait(60) and r.finish_reason["type"] == "abort"
    while scheduler.running:  # the batch stores the prefix as it ends
      time.sleep(0.01)
    (key, kept), = scheduler.prefixes.items()
    assert key == tuple(r.input_ids + r.tokens)
    assert kept.k.shape == (cfg.num_layers, cfg.num_kv_heads, len(key), cfg.head_dim)
    scheduler.update_weights(params[1], "1", None)
    assert not scheduler.prefixes
  finally:
    with scheduler.lock:
      scheduler.stopped = True
      scheduler.lock.notify_all()


def test_an_unpaused_weight_update_lets_the_requests_in_flight_finish_first(model):
  """In process, as behind SGLang's model-update lock: an update sent while a request
  decodes waits for it, which ends on the old weights; a request that arrives meanwhile
  waits for the update and decodes on the new ones."""
  from rollouts.server.protocol import Request as ServerRequest
  from rollouts.server.scheduler import Scheduler
  cfg, params, _, _ = model
  scheduler = Scheduler(cfg, params[0], weight_version="0")

  def request(rid, max_new):
    return ServerRequest(rid=rid, input_ids=[3, 17, 22], max_new_tokens=max_new,
                         temperature=0.0, top_p=1.0, stop_token_ids=(), seed=0,
                         return_logprob=False)
  try:
    early = request("early", 400)
    scheduler.submit([early])
    with scheduler.lock:
      assert scheduler.lock.wait_for(lambda: len(early.tokens) >= 5, 120)
    update = threading.Thread(target=scheduler.update_weights, args=(params[1], "1", None))
    update.start()
    with scheduler.lock:
      assert scheduler.lock.wait_for(lambda: scheduler.updating, 60)
      assert len(early.tokens) < 400, "the request ended before the update came"
    late = request("late", 8)
    scheduler.submit([late])
    assert early.done.wait(120) and late.done.wait(120)
    update.join(timeout=60)
    assert not update.is_alive() and scheduler.weight_version == "1"
    assert len(early.tokens) == 400 and set(early.versions) == {"0"}
    assert len(late.tokens) == 8 and set(late.versions) == {"1"}
  finally:
    with scheduler.lock:
      scheduler.stopped = True
      scheduler.lock.notify_all()


class _SlowlyVerified(Arithmetic):
  """Arithmetic whose verifier takes `seconds` per completion and notes when it ran."""

  def __init__(self, seconds: float, **kwargs):
    super().__init__(**kwargs)
    self.seconds, self.verified_at = seconds, []

  def verify(self, completion, record):
    self.verified_at.append(time.perf_counter())
    time.sleep(self.seconds)
    return super().verify(completion, record)


class _Returned:
  """An engine's generate, with the moment it returned noted."""

  def __init__(self, engine):
    self.engine, self.returned_at = engine, None

  def generate(self, *args, **kwargs):
    completions = self.engine.generate(*args, **kwargs)
    self.returned_at = time.perf_counter()
    return completions


def test_completions_from_a_server_are_verified_while_the_rest_generate(model, tokenizer):
  """A server that decodes two requests at a time hands back 8 completions in 4 waves: the
  first are verified while later waves decode, the result equals verifying them all after,
  and what was verified during generation is off the critical path (verify_s)."""
  from rollouts.server.http_server import serve
  cfg, params, _, _ = model
  server = serve(cfg, params[0], max_batch=2)
  client = SGLangClient([f"http://127.0.0.1:{server.server_address[1]}"])
  try:
    task = _SlowlyVerified(0.02, digits=1, num_train=8, num_test=4)
    engine = _Returned(SGLangEngine(client, cfg, weights_dir="unused"))
    records = [task.train[i] for i in range(4)]
    timings = {}
    trajectories = rollout.generate(engine, task, tokenizer, records,
                                    # Stop on 5 of the 55 ids: ~11 tokens each.
                                    SamplingParams(32, stop_token_ids=(3, 4, 5, 6, 7)),
                                    samples=2, seed=5, timings=timings)
  finally:
    client.close()
    server.shutdown()
    with server.scheduler.lock:
      server.scheduler.stopped = True
      server.scheduler.lock.notify_all()
  assert min(task.verified_at) < engine.returned_at, "nothing was verified during generation"
  assert len(task.verified_at) == sum(not t.truncated for t in trajectories) > 0
  assert timings["verify_busy_s"] >= 0.02 * len(task.verified_at)
  assert timings["verify_s"] < timings["verify_busy_s"]
  during = [(t.text, t.correct, t.truncated) for t in trajectories]
  rollout.verify(task, tokenizer, trajectories)  # all of them again, after
  assert [(t.text, t.correct, t.truncated) for t in trajectories] == during
  assert [t.record for t in trajectories] == [r for r in records for _ in "ab"]


def test_warmup_compiles_every_batch_shape_served_after_it(model):
  """After Scheduler.warmup(L), batches of any size up to max_batch whose requests hold at
  most L tokens, a resumed one served from the prefix cache included, compile no prefill and
  no decode step."""
  from rollouts import decoding
  from rollouts.server.protocol import Request
  from rollouts.server.scheduler import Scheduler
  assert [decoding.shape_bucket(n, 8) for n in (1, 8, 9, 12, 13, 17, 25, 33, 49, 65)] == [
      8, 8, 12, 12, 16, 24, 32, 48, 64, 96]
  cfg, params, _, _ = model
  scheduler = Scheduler(cfg, params[0], max_batch=12)

  def requests(name, prompts, max_new):
    return [Request(rid=f"{name}-{i}", input_ids=list(p), max_new_tokens=max_new,
                    temperature=1.0, top_p=0.9, stop_token_ids=(), seed=i, return_logprob=True)
            for i, p in enumerate(prompts)]

  def served(batch):
    scheduler.submit(batch)
    assert all(r.done.wait(120) for r in batch)
    return batch

  try:
    scheduler.warmup(24)
    compiled = (decoding.prefill_logits._cache_size(), decoding.decode_step._cache_size())
    served(requests("a", [[3] * 3, [4] * 9, [5] * 20], 4))
    served(requests("b", [[6] * n for n in range(1, 11)], 14))
    long, = requests("c", [[7, 8, 9]], 21)
    scheduler.submit([long])
    # Abort while holding the scheduler's lock, woken by its notify after each token: a
    # polling loop could wake up only after all 21 tokens (decode steps take ~1 ms here).
    with scheduler.lock:
      assert scheduler.lock.wait_for(lambda: len(long.tokens) >= 5, 60)
      scheduler.abort("c-")
    assert long.done.wait(60) and long.finish_reason["type"] == "abort"
    while scheduler.running:
      time.sleep(0.01)
    resumed, = served(requests("d", [long.input_ids + long.tokens], 21 - len(long.tokens)))
    assert resumed.cached_tokens == len(resumed.input_ids)
    assert resumed.finish_reason["type"] == "length"
    assert (decoding.prefill_logits._cache_size(),
            decoding.decode_step._cache_size()) == compiled
  finally:
    with scheduler.lock:
      scheduler.stopped = True
      scheduler.lock.notify_all()


def test_killed_server_moves_its_work_and_keeps_what_was_received(model):
  _, _, paths, _ = model
  started = [launch(["--hf_checkpoint", paths[0], "--max_batch", "4", *F32]) for _ in range(2)]
  urls = [url for _, url in started]
  try:
    client = SGLangClient(urls, max_in_flight=2, retries=1, retry_backoff=0.05)
    requests = [Request(f"k-{i}", (7, i % 40 + 3), 60, affinity=i) for i in range(16)]
    thread, out = _generate_in_background(client, requests, greedy(60))
    assert _wait_for_tokens(urls[0], 20, thread)
    started[0][0].kill()  # mid-iteration
    thread.join()
    completions = out["result"]
    assert len(completions) == 16 and all(len(c.token_ids) == 60 for c in completions)
    assert client.down == {urls[0]}
    # Every server down: a clear error that keeps the completions already received (two
    # short requests finish on the live server before a long one is cut by the kill).
    client2 = SGLangClient(urls[1:], max_in_flight=1, retries=0)
    last = [Request(f"s-{i}", (9, i + 3), 8) for i in range(2)] + [Request("l-0", (9, 30), 1000)]
    thread, out = _generate_in_background(client2, last, greedy(1000))
    assert _wait_for_tokens(urls[1], 60, thread)
    started[1][0].kill()
    thread.join()
  finally:
    for process, _ in started:
      process.kill()
      process.wait()
  error = out["error"]
  assert f"every server is down ({urls[1]})" in str(error)
  assert sorted(error.completed) == [0, 1]
  assert all(len(c.token_ids) == 8 for c in error.completed.values())


def test_each_engine_sends_rids_under_a_prefix_of_its_own(model):
  """Two trainers on one fleet never send the same rid (SGLang refuses a live one): each
  engine's rids begin with "longrl-" and 8 random hex digits, then its call and index."""
  cfg = model[0]
  engines = [SGLangEngine(SGLangClient(["http://127.0.0.1:1"]), cfg, weights_dir="unused")
             for _ in range(2)]
  try:
    rids = [e.requests([[1, 2], [3]], 4, seed=0)[1].rid for e in engines]
  finally:
    for e in engines:
      e.client.close()
  assert all(re.fullmatch(r"longrl-[0-9a-f]{8}-g1-1", rid) for rid in rids), rids
  assert rids[0] != rids[1]


def test_clear_errors_for_down_error_and_wrong_shape(servers):
  urls, _ = servers
  with pytest.raises(ServerError, match=r"127\.0\.0\.1:1 \(ClientConnectorError"):
    SGLangClient(["http://127.0.0.1:1"]).check_health()
  bad = SamplingParams(4, top_p=1.0)
  with pytest.raises(ServerError, match=r"/generate answered HTTP 400: .*input_ids"):
    SGLangClient(urls[:1]).generate([Request("e-1", (), 4)], bad)

  class WrongShape(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      payload = json.dumps({"output_ids": [1], "meta_info": {"finish_reason": "done"}}).encode()
      self.send_response(200)
      self.send_header("Content-Length", str(len(payload)))
      self.end_headers()
      self.wfile.write(payload)

    def log_message(self, *args):
      pass

  fake = http.server.HTTPServer(("127.0.0.1", 0), WrongShape)
  threading.Thread(target=fake.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{fake.server_address[1]}"
  with pytest.raises(ServerError, match=rf"{url}/generate answered JSON of the wrong shape"):
    SGLangClient([url]).generate([Request("e-2", (1,), 4)], bad)
  fake.shutdown()


def test_a_run_that_cannot_reach_its_server_names_it_within_the_timeout(model, tmp_path):
  cfg, params, _, _ = model
  silent = socket.socket()  # accepts connections, never answers
  silent.bind(("127.0.0.1", 0))
  silent.listen()
  closed = socket.socket()
  closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
  try:
    for sock in (silent, closed):
      url = f"http://127.0.0.1:{sock.getsockname()[1]}"
      started = time.monotonic()
      with pytest.raises(ServerError, match=rf"not healthy within 2 s: {url} \("):
        remote_engine(cfg, params, 0, urls=[url], weights_dir=str(tmp_path),
                      health_timeout=2.0)
      assert time.monotonic() - started < 10
  finally:
    silent.close()
    closed.close()


def _resumed(t, n: int, token: int = 9, logprob: float = 0.0, version: int = 0):
  """Trajectory `t` as resumed with `n` tokens already generated."""
  t.token_ids, t.logprobs, t.versions = [token] * n, [logprob] * n, [version] * n
  t.policy_mask, t.policy_count = [True] * n, n


def _groups(prompts, size: int, first_record: int = 0):
  """Fresh single-turn trajectories: group g (record first_record + g) of `size` samples on
  prompts[g]."""
  count = len(prompts) * size
  return driver.start(envs.ONE_TURN, [{}] * count, [p for p in prompts for _ in range(size)],
                      group=[i // size for i in range(count)],
                      record_index=[first_record + i // size for i in range(count)],
                      sample=[i % size for i in range(count)])


def test_partial_rollouts_abort_resume_and_keep_versions(model, servers, tokenizer):
  cfg, params, paths, root = model
  urls, _ = servers
  engine = SGLangEngine(SGLangClient(urls), cfg, weights_dir=root)
  sampling = SamplingParams(120, temperature=1.0)  # no stop token: every sample runs 120
  trajectories = _groups(PROMPTS[:2], 3)
  # One was resumed with 100 tokens already: it finishes first and spends the budget.
  head = trajectories[0]
  _resumed(head, 100)
  advance = lambda pause, seed: driver.advance(engine, envs.ONE_TURN, tokenizer, trajectories,
                                               sampling, seed=seed, pause=pause)
  first = advance(driver.Pause(token_budget=1), 0)
  assert head.finish == "length"
  assert first["unfinished"] >= 1 and any(0 < len(t.token_ids) < 120 for t in trajectories)
  engine.client.sync_weights(paths[1], 1)
  while not all(t.over for t in trajectories):
    advance(driver.Pause(token_budget=10**6), 1)
  for t in trajectories:
    assert len(t.token_ids) == len(t.logprobs) == len(t.versions) == 120
    assert t.finish == "length"
    assert np.all(np.diff(t.versions) >= 0) and set(t.versions) <= {0, 1}
  assert any(set(t.versions) == {0, 1} for t in trajectories)
  done, rest = replay.complete_groups(trajectories)
  assert [g[0].group for g in done] == [0, 1] and rest == []
  engine.client.sync_weights(paths[0], 0)


def test_exports_keep_the_versions_servers_may_read_even_after_a_resume(model, tmp_path):
  """Each export keeps itself and the version below it; a weights directory left by a run
  that got further (this one resumed from an earlier step) loses those later versions, not
  the export just written."""
  cfg, params, _, _ = model
  for stale in ("v000003", "v000004"):
    (tmp_path / stale).mkdir()
  client = SGLangClient(["http://127.0.0.1:9"])  # export talks to no server
  try:
    engine = SGLangEngine(client, cfg, weights_dir=str(tmp_path))
    engine.export(params[0], 1)
    assert sorted(os.listdir(tmp_path)) == ["v000001"]
    engine.export(params[1], 2)
    engine.export(params[0], 3)
    assert sorted(os.listdir(tmp_path)) == ["v000002", "v000003"]
    assert (tmp_path / "v000003" / "model.safetensors").exists()
  finally:
    client.close()


def test_replay_buffer_round_trip():
  trajectories = []
  for g in range(3):
    trajectories += _groups([[1, 2, g + 3]], 2, first_record=10 + g)
    for t in trajectories[-2:]:
      t.group = g
  for i, t in enumerate(trajectories):
    _resumed(t, i, logprob=-1.0, version=i % 2)
    t.logprobs = [-float(k) for k in range(i)]
    t.finish = "stop" if i % 3 == 0 else None
  records = [{"index": i} for i in range(16)]
  buffer = replay.ReplayBuffer.empty(8, 4, 8).store(trajectories)
  back = buffer.trajectories(records)
  assert [(t.group, t.record_index, t.sample, t.prompt_ids, t.finish) for t in back] == \
      [(t.group, t.record_index, t.sample, t.prompt_ids, t.finish) for t in trajectories]
  for a, b in zip(back, trajectories):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.versions, b.versions)
    assert a.record == records[b.record_index]
  with pytest.raises(ValueError, match="capacity 4"):
    replay.ReplayBuffer.empty(4, 4, 8).store(trajectories)


def test_replay_buffer_is_part_of_the_checkpoint(tiny_cfg, tiny_params, tokenizer, tmp_path):
  task = Arithmetic(num_train=4)
  make = lambda: loop.init_state(tiny_params, loop.rl_optimizer(1e-4), helpers.parts(
      tiny_cfg, engine=None, task=task, tokenizer=tokenizer,
      config=RLConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, seq_len=16),
      rollouts=sources.Partial(token_budget=8)), 0)
  waiting = _groups([[1, 2, 3]], 2, first_record=3)
  for t in waiting:
    t.group = 5
  _resumed(waiting[0], 2, version=4)
  waiting[0].token_ids, waiting[0].logprobs = [7, 8], [-1.0, -2.0]
  state = make()
  state = state.replace(rollout=state.rollout.replace(source={
      "replay": state.rollout.source["replay"].store(waiting), "next_group": np.int32(6)}))
  checkpointer = Checkpointer(str(tmp_path / "ckpt"))
  checkpointer.save(1, state)
  restored = checkpointer.restore(make())
  checkpointer.close()
  back = restored.rollout.source["replay"].trajectories(task.train)
  assert int(restored.rollout.source["next_group"]) == 6 and len(back) == 2
  assert back[0].token_ids == [7, 8] and back[0].versions == [4, 4]
  assert back[1].prompt_ids == (1, 2, 3) and not back[1].over


def test_offpolicy_tokens_masked_or_importance_weighted():
  versions = [[3, 3, 4, 4], [4, 4]]
  trajectories = []
  for v in versions:
    (t,) = _groups([[1]], 1)
    _resumed(t, len(v))
    t.versions = v
    trajectories.append(t)
  masks = batch_lib.train_masks(trajectories, np.array([True, False]))
  assert [m.tolist() for m in masks] == [[True] * 4, [False] * 2]
  batch, _ = trajectory_batch([[1, 2], [1]], [[5, 6, 7, 8], [5, 6]],
                              [np.log([0.5, 0.5, 0.5, 0.5]), np.log([0.5, 0.5])], [2.0, 2.0],
                              masks, 16, token_fields=batch_lib.trajectory_fields(
                                  trajectories, {"versions"}))
  # "mask" drops the tokens older than the step's version: only version 4's stay.
  masked, _ = corrections.mask_stale().apply(batch, step=4, trainer_logp=None)
  assert masked.loss_mask[0].tolist()[:7] == [0, 0, 0, 1, 1, 0, 0]
  kept, _ = corrections.keep().apply(batch, step=4, trainer_logp=None)
  assert kept.loss_mask[0].tolist()[:7] == [0, 1, 1, 1, 1, 0, 0]
  batch = masked
  # TIS: old log-probs become the trainer's; advantages times min(pi_trainer / pi_engine, cap).
  trainer = np.where(batch.loss_mask > 0, np.log(0.9), 0.0).astype(np.float32)
  tis, _ = corrections.tis(cap=1.5).apply(batch, step=4, trainer_logp=trainer)
  measured = corrections.measure(batch, trainer)  # what the loop logs of the batch
  mean, worst = measured["engine_logp_diff_mean"], measured["engine_logp_diff_max"]
  np.testing.assert_allclose(tis.old_logp, trainer)
  weighted = tis.advantages[batch.loss_mask > 0]
  np.testing.assert_allclose(weighted, 2.0 * 1.5)  # 0.9 / 0.5 = 1.8, capped at 1.5
  np.testing.assert_allclose([mean, worst], [np.log(1.8)] * 2, rtol=1e-5)
  untouched = (batch.loss_mask == 0)
  np.testing.assert_array_equal(tis.advantages[untouched], batch.advantages[untouched])


def test_lambda_partial_rollouts_pause_at_the_count_and_resume_intact(model, servers, tokenizer):
  cfg, params, paths, root = model
  urls, _ = servers
  engine = SGLangEngine(SGLangClient(urls[:1]), cfg, weights_dir=root)  # one batch, in order
  sampling = SamplingParams(120, temperature=1.0)  # no stop token: every sample runs 120
  # N x K = 4 groups x 4 = 16. Groups 0 and 1 were resumed 3..10 tokens short of the limit,
  # so they finish one after another while groups 2 and 3 are still young.
  trajectories = _groups([PROMPTS[g % 3] for g in range(4)], 4, first_record=10)
  for i, t in enumerate(trajectories[:8]):
    _resumed(t, 120 - 3 - i, logprob=-0.5)
  advance = lambda ts, fraction, seed: driver.advance(
      engine, envs.ONE_TURN, tokenizer, ts, sampling, seed=seed,
      pause=driver.Pause(finish_fraction=fraction))
  result = advance(trajectories, 0.5, 0)
  # lambda = 0.5: paused once 8 of the 16 had finished; the other 8 were aborted.
  assert (result["finished"], result["unfinished"]) == (8, 8)
  assert all(t.over for t in trajectories[:8])
  young = trajectories[8:]
  assert not any(t.over for t in young)
  assert all(len(t.token_ids) < 120 for t in young) and any(len(t.token_ids) for t in young)
  done, rest = replay.complete_groups(trajectories)
  assert [g[0].group for g in done] == [0, 1] and rest == young
  kept = {(t.group, t.sample): (list(t.token_ids), list(t.logprobs), list(t.versions))
          for t in rest}
  # Into the replay buffer (as the loop stores it) and out at the next iteration.
  buffer = replay.ReplayBuffer.empty(16, 16, 120).store(rest)
  resumed = buffer.trajectories([{}] * 16)
  assert [(t.group, t.sample, t.record_index) for t in resumed] == [
      (t.group, t.sample, t.record_index) for t in rest]
  for t in resumed:
    for got, want in zip((t.token_ids, t.logprobs, t.versions), kept[(t.group, t.sample)]):
      np.testing.assert_array_equal(got, want)
  engine.client.sync_weights(paths[1], 1)
  try:
    result = advance(resumed, 1.0, 1)
    assert result["finished"] == 8 and all(t.over for t in resumed)
    for t in resumed:
      tokens, logprobs, versions = kept[(t.group, t.sample)]
      n = len(tokens)
      assert len(t.token_ids) == len(t.logprobs) == len(t.versions) == 120
      np.testing.assert_array_equal(t.token_ids[:n], tokens)
      np.testing.assert_array_equal(t.logprobs[:n], logprobs)
      assert t.versions[:n] == versions == [0] * n
      assert t.versions[n:] == [1] * (120 - n)  # the rest by the new weights
  finally:
    engine.client.sync_weights(paths[0], 0)


def test_lambda_finish_target_and_pause_arguments():
  assert [driver.finish_target(n, lam) for n, lam in
          [(16, 0.5), (10, 0.3), (3, 0.5), (5, 0.01), (16, 1.0), (7, 0.7)]] == [8, 3, 2, 1, 16, 5]
  for kwargs in ({}, {"token_budget": 8, "finish_fraction": 0.5}, {"finish_fraction": 1.5}):
    with pytest.raises(ValueError, match="give token_budget > 0 .* or finish_fraction in"):
      driver.Pause(**kwargs)


def test_trust_region_masks_exactly_the_tokens_outside_the_window():
  batch, _ = trajectory_batch([[1, 2], [1]], [[5, 6, 7, 8], [5, 6]],
                              [np.log([0.5] * 4), np.log([0.25] * 2)], [2.0, -1.0],
                              [np.array([True] * 4), np.array([True, True])], 16)
  inside = batch.loss_mask > 0
  assert inside.sum() == 6
  # trainer - engine log-ratio per loss token, in order: window (-1, 1).
  ratio = np.array([-1.5, -0.999, 0.3, 1.001, 0.999, -2.0], np.float32)
  trainer = np.array(batch.old_logp, np.float32)
  trainer[inside] += ratio
  window = lambda low, high: corrections.trust_region(low=low, high=high).apply(
      batch, step=0, trainer_logp=trainer)
  out, metrics = window(-1.0, 1.0)
  measured = corrections.measure(batch, trainer)  # what the loop logs of the batch
  mean, worst, masked = (measured["engine_logp_diff_mean"], measured["engine_logp_diff_max"],
                         metrics["trust_region_masked"])
  assert measured["would_mask_trust_region"] == masked
  expect = np.array(batch.loss_mask)
  expect[inside] = [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
  np.testing.assert_array_equal(out.loss_mask, expect)
  np.testing.assert_array_equal(out.old_logp, batch.old_logp)  # "keep" for the rest
  np.testing.assert_array_equal(out.advantages, batch.advantages)
  assert masked == pytest.approx(3 / 6)
  np.testing.assert_allclose([mean, worst], [np.abs(ratio).mean(), 2.0], rtol=1e-5)
  # A window holding every ratio masks nothing.
  out, metrics = window(-3.0, 3.0)
  assert metrics["trust_region_masked"] == 0.0
  np.testing.assert_array_equal(out.loss_mask, batch.loss_mask)


def test_partial_and_offpolicy_bindings_that_cannot_run_fail_before_compiling(
    tmp_path, tiny_cfg, tiny_params, tokenizer, model, servers):
  from rl import ConfigError
  cfg, _, _, root = model
  urls, _ = servers
  server = SGLangEngine(SGLangClient(urls[:1]), cfg, weights_dir=root)
  context = lambda engine: sources.Context(engine, Arithmetic(), tokenizer, RLConfig(),
                                           sampling.uniform())
  for partial, message in [
      (sources.Partial(), r"give token_budget > 0 \(k1.5\) or finish_fraction in \(0, 1\]"),
      (sources.Partial(finish_fraction=1.5), r"finish_fraction in \(0, 1\]"),
      (sources.Partial(token_budget=8, finish_fraction=0.5), "not both")]:
    with pytest.raises(ConfigError, match=message):
      sources.check(partial, context(server))
  with pytest.raises(ConfigError, match="low < 0 < high"):
    corrections.trust_region(low=0.5, high=1.0)
  from experiments import gin_externals  # noqa: F401 - registers the corrections
  from experiments import run as run_lib
  with pytest.raises(SystemExit, match=r"No configurable matching reference '@drop\(\)'"):
    run_lib.load_config([os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "experiments/configs/quickstart.gin")],
                        ["Objective.correction = @drop()"])
  with pytest.raises(ConfigError, match="needs an engine that can abort"):
    sources.check(sources.Partial(finish_fraction=0.5), context(JaxEngine(tiny_cfg, tiny_params)))
  # fine: lambda mode needs no token budget
  sources.check(sources.Partial(finish_fraction=0.5), context(server))
  server.client.close()
  # Through train: before the run directory exists, let alone a compile.
  with pytest.raises(ConfigError, match="finish_fraction in"):
    trainer.train(str(tmp_path / "run"), task=Arithmetic(), model=config.tiny,
                  rollouts=sources.Partial(finish_fraction=0.0),
                  hooks=trainer.Hooks(progress=False))
  assert not (tmp_path / "run").exists()


def test_server_from_a_gin_file(tmp_path):
  config_file = tmp_path / "server.gin"
  config_file.write_text("load_model.model = @tiny\ntiny.hidden_size = 32\n"
                         "tiny.intermediate_size = 64\nload_model.seed = 3\n")
  process, url = launch(["--gin", str(config_file), "--weight_version", "5"],
                        module="experiments.serve")
  try:
    client = SGLangClient([url])
    client.check_health()
    assert client.model_info()[url]["weight_version"] == "5"
    out = client.generate([Request("g-1", (4, 5, 6), 5)], greedy(5))[0]
    assert len(out.token_ids) == 5 and out.versions.tolist() == [5] * 5
  finally:
    process.kill()
    process.wait()


# --- a fleet behind the real sglang-router (rollouts/router.py)


def _server_at(path: str, port: int):
  return launch(["--hf_checkpoint", path, "--port", str(port), "--max_batch", "4", *F32])


def _wait_until_routed(router_url: str, urls) -> None:
  """Until the router lists every one of `urls` as a healthy worker (at most 30 s)."""
  from rollouts import router
  deadline = time.monotonic() + 30
  while not set(urls) <= {w["url"] for w in router.workers(router_url) if w["is_healthy"]}:
    assert time.monotonic() < deadline, router.workers(router_url)
    time.sleep(0.2)


def test_fleet_behind_the_router_survives_a_dead_server_and_takes_it_back(model):
  from rollouts import router

  _, _, paths, _ = model
  started = [launch(["--hf_checkpoint", paths[0], "--max_batch", "4", *F32]) for _ in range(2)]
  urls = [url for _, url in started]
  router_process, router_url = router.launch(urls)
  processes = [p for p, _ in started] + [router_process]
  try:
    client = SGLangClient(urls, router=router_url, max_in_flight=4, retries=2,
                          retry_backoff=0.2)
    reference = SGLangClient(urls[1:], retries=0)
    requests = [Request(f"f-{i}", (7, i % 40 + 3), 60, affinity=i) for i in range(12)]
    # Through the router, tokens and log-probs are the server's own.
    direct = reference.generate(requests[:2], greedy(60))
    via = client.generate(requests[:2], greedy(60))
    for a, b in zip(direct, via):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # A server killed mid-iteration: the router re-sends its requests (same rid) elsewhere.
    # The one killed is frozen first with requests running, so it surely holds some.
    for attempt in range(5):  # on a busy machine an iteration may end before a poll sees it
      requests = [Request(f"f-{attempt}.{i}", (7, i % 40 + 3), 60, affinity=i)
                  for i in range(12)]
      thread, out = _generate_in_background(client, requests, greedy(60))
      busy = _freeze_a_busy_server(urls, thread)
      if busy is not None:
        break
      thread.join()
    else:
      raise AssertionError(f"no server of {urls} was seen generating in 5 iterations")
    started[0], started[busy] = started[busy], started[0]
    urls[0], urls[busy] = urls[busy], urls[0]
    started[0][0].kill()
    reference.close()
    reference = SGLangClient(urls[1:], retries=0)  # the live one
    thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert len(out["result"]) == 12 and all(len(c.token_ids) == 60 for c in out["result"])
    # The weight sync drops the dead server and reaches the live one at the new version.
    client.sync_weights(paths[1], 1)
    assert client.down == {urls[0]}
    assert reference.model_info()[urls[1]]["weight_version"] == "1"
    # It comes back on its port with the old weights; the next sync brings it to the
    # current version, and the router routes to it again.
    port = int(urls[0].rsplit(":", 1)[1])
    started[0] = _server_at(paths[0], port)
    processes.append(started[0][0])
    client.sync_weights(paths[1], 2)
    assert client.down == set()
    assert {u: i["weight_version"] for u, i in client.model_info().items()} == \
        {urls[0]: "2", urls[1]: "2"}
    _wait_until_routed(router_url, urls)
    again = client.generate(requests, greedy(8))
    assert {int(v) for c in again for v in c.versions} == {2}
    # A new server, started on the old weights, loads the current ones before it joins: the
    # router lists it, and whatever it is sent comes from version 2.
    started.append(launch(["--hf_checkpoint", paths[0], "--max_batch", "4", *F32]))
    processes.append(started[-1][0])
    client.add_worker(started[-1][1], paths[1], 2)
    assert client.model_info()[started[-1][1]]["weight_version"] == "2"
    _wait_until_routed(router_url, [started[-1][1]])  # registered once it answers /health
    assert {int(v) for c in client.generate(requests, greedy(8)) for v in c.versions} == {2}
    # The router killed: a clear error naming it, with what was received kept.
    router.stop(router_process)
    with pytest.raises(ServerError, match=f"router {router_url} failed"):
      client.generate(requests[:2], greedy(8))
  finally:
    client.close()
    reference.close()
    router.stop(router_process)
    for process in processes:
      if process is not router_process:
        process.kill()
        process.wait()
