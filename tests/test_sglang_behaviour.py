"""What the real SGLang 0.5.23 server does where a client can go wrong, mirrored by our server
(rollouts/server/), and the client (rollouts/sglang.py) meeting each (docs/sglang.md cites
the lines of SGLang behind every one): aborts by exact live rid, duplicate rids refused,
/health blocking while paused (and the router's 503 meanwhile), a failed update, deadlines on
control calls, sampling_seed only with deterministic inference, the served dtype."""

import dataclasses
import os
import signal
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from safetensors import safe_open

from models import hf
from rollouts import router
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from rollouts.server import scheduler as scheduler_module
from rollouts.server.main import launch, served_dtype
from rollouts.sglang import Request, SGLangClient, ServerError
from rollouts.sglang_engine import SGLangEngine, remote_engine
from tests import helpers

PAUSED = {"message": "Generation paused successfully.", "status": "ok"}


def _in_background(function):
  out = {}

  def run():
    try:
      out["result"] = function()
    except Exception as e:  # noqa: BLE001 - handed to the test
      out["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, out


def _generate(url, rid, max_new, sampling=None):
  return httpx.post(url + "/generate", timeout=60, json={
      "rid": rid, "input_ids": [3, 17, 22], "return_logprob": True,
      "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, **(sampling or {})}})


def _running(url) -> int:
  return httpx.get(url + "/v1/loads").json()["loads"][0]["num_running_reqs"]


def _wait(condition, seconds=60.0, what="the condition"):
  deadline = time.monotonic() + seconds
  while not condition():
    if time.monotonic() > deadline:
      raise TimeoutError(f"{what} did not hold within {seconds} s")
    time.sleep(0.02)


def test_only_an_exact_live_rid_aborts_and_partial_rollouts_keep_their_budget(tiny_cfg,
                                                                                tiny_params,
                                                                                tmp_path):
  """SGLang's /abort_request drops a rid it does not hold (a prefix aborts nothing); the
  client aborts a call's requests in flight by their own rids, so a token budget holds."""
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    thread, out = _in_background(lambda: _generate(url, "long-1", 300).json())
    _wait(lambda: _running(url), what="the request running")
    for rid in ("long-", "", "long-1#0", "other"):
      assert httpx.post(url + "/abort_request", json={"rid": rid}).status_code == 200
    thread.join(60)
    assert out["result"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["result"]["output_ids"]) == 300
    thread, out = _in_background(lambda: _generate(url, "long-2", 300).json())
    _wait(lambda: _running(url), what="the request running")
    httpx.post(url + "/abort_request", json={"rid": "long-2"})
    thread.join(60)
    assert out["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["result"]["output_ids"]) < 300
    # A partial-rollout call: once the short one is back, the long ones stop.
    engine = SGLangEngine(SGLangClient([url]), tiny_cfg, weights_dir=str(tmp_path))
    try:
      got = engine.generate([[3, 4]] * 4, SamplingParams(max_new_tokens=300), seed=0,
                            max_new_tokens=[2, 300, 300, 300],
                            stop_when=lambda index, completion: index == 0)
    finally:
      engine.close()
    assert [c.finish_reason for c in got] == ["length", "abort", "abort", "abort"]
    assert all(len(c.token_ids) < 300 for c in got[1:])


def test_aborts_that_empty_the_queue_while_a_batch_gathers_leave_the_scheduler_serving(
    tiny_cfg, tiny_params, monkeypatch):
  """A request aborted while the scheduler waits for more to join its batch (a wait made
  long here) leaves an empty queue behind; the scheduler goes back to waiting (it once died
  there, and every later request waited forever)."""
  monkeypatch.setattr(scheduler_module, "GATHER_SECONDS", 0.3)
  with helpers.serving(tiny_cfg, tiny_params) as (url, scheduler):
    for attempt in range(3):
      thread, _ = _in_background(lambda: _generate(url, f"gone-{attempt}", 4))
      deadline = time.monotonic() + 30
      while not scheduler.waiting and thread.is_alive():
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.0005)
      httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
      thread.join(30)
      time.sleep(0.7)  # the gather's two waits, then the batch it makes of an empty queue
      assert not thread.is_alive() and scheduler.thread.is_alive(), attempt
    assert _generate(url, "after", 4).status_code == 200


def test_a_live_rid_is_refused_and_a_retry_goes_under_a_fresh_one(tiny_cfg, tiny_params):
  """SGLang refuses a rid it still holds (400, "Duplicate request ID detected"), also while
  paused; the client's retry after a read timeout sends the request under a rid of its own."""
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).json() == PAUSED
    first, _ = _in_background(lambda: _generate(url, "dup", 4))
    time.sleep(0.3)
    again = _generate(url, "dup", 4)
    assert again.status_code == 400
    assert again.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
    client = SGLangClient([url], read_timeout=1.0, retries=6, retry_backoff=0.2)
    try:
      thread, out = _in_background(lambda: client.generate(
          [Request("r", (3, 17, 22), 4)], SamplingParams(max_new_tokens=4)))
      time.sleep(2.5)  # its first attempt has timed out by now, and is still held there
      httpx.post(url + "/continue_generation", json={})
      thread.join(60)
      assert "error" not in out, out.get("error")
      assert len(out["result"][0].token_ids) == 4
    finally:
      client.close()
    first.join(60)


def test_a_failed_weight_update_leaves_the_server_serving(tiny_cfg, tiny_params, tmp_path):
  """The update fails (no checkpoint there): the client resumes the worker it paused before
  it reports the error (a paused SGLang worker makes every later request wait)."""
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    client = SGLangClient([url], retries=0)
    try:
      with pytest.raises(ServerError, match="update_weights_from_disk"):
        client.sync_weights(str(tmp_path / "missing"), 1)
      assert httpx.get(url + "/ready").status_code == 200  # 503 while paused
      out = client.generate([Request("after", (3, 4), 3)], SamplingParams(max_new_tokens=3))
      assert len(out[0].token_ids) == 3
    finally:
      client.close()


def test_an_update_whose_cache_flush_is_refused_fails(tiny_cfg, tiny_params, tmp_path):
  """Paused in place with a request frozen mid-generation, SGLang loads the new weights but
  refuses to flush the cache (not idle), so the update answers success false and the
  version stays (weight_updater.py L120-133); /flush_cache is refused alike until the
  request is let go and finishes. Paused with abort (as the client pauses) it succeeds."""
  path = hf.save(tiny_params, tiny_cfg, str(tmp_path / "v1"))
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    thread, out = _in_background(lambda: _generate(url, "long", 1000).json())
    _wait(lambda: _running(url) == 1, what="the request running")
    httpx.post(url + "/pause_generation", json={"mode": "in_place"})
    update = httpx.post(url + "/update_weights_from_disk", timeout=60, json={
        "model_path": path, "weight_version": "1"})
    assert update.status_code == 400 and update.json()["success"] is False
    assert "cache was not flushed" in update.json()["message"]
    assert httpx.get(url + "/model_info").json()["weight_version"] == "0"
    assert httpx.post(url + "/flush_cache").status_code == 400
    httpx.post(url + "/continue_generation", json={})
    thread.join(60)
    assert len(out["result"]["output_ids"]) == 1000
    assert httpx.post(url + "/flush_cache").status_code == 200
    client = SGLangClient([url])
    try:
      client.sync_weights(path, 1)  # pauses with abort: idle, flushed
      assert client.model_info()[url]["weight_version"] == "1"
    finally:
      client.close()


def test_ready_stays_503_after_a_failed_health_check_until_one_passes(tiny_cfg, tiny_params,
                                                                       monkeypatch):
  """SGLang marks itself unhealthy when a health check fails (here: paused past
  SGLANG_HEALTH_CHECK_TIMEOUT), and /ready answers 503 until a check passes again, even
  after /continue_generation (http_server.py L784-798, tokenizer_manager.py L728-734)."""
  monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    assert httpx.get(url + "/ready").status_code == 200
    httpx.post(url + "/pause_generation", json={"mode": "abort"})
    assert httpx.get(url + "/health", timeout=30).status_code == 503
    httpx.post(url + "/continue_generation", json={})
    assert httpx.get(url + "/ready").status_code == 503
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/ready").status_code == 200


def test_health_blocks_while_paused_and_the_router_is_waited_out(tiny_cfg, tiny_params,
                                                                  monkeypatch):
  """SGLang's /health generates a token: it blocks while the worker is paused (or loads
  weights) and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT; /ready is 503 while paused.
  The router then marks the worker unhealthy and answers 503: the client waits that out."""
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # compiles its shape
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    httpx.post(url + "/pause_generation", json={"mode": "abort"})
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=30).status_code == 503
    assert time.monotonic() - started >= 1.0
    assert httpx.get(url + "/ready").status_code == 503
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    assert httpx.get(url + "/health").status_code == 200  # SGLang's switch: no generation
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 503
    monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    httpx.post(url + "/continue_generation", json={})
    router_process, router_url = router.launch([url])
    client = SGLangClient([url], router=router_url, retries=1, retry_backoff=0.2)
    try:
      httpx.post(url + "/pause_generation", json={"mode": "abort"})
      _wait(lambda: not any(w["is_healthy"] for w in router.workers(router_url)), 30,
            "the router marking the paused worker unhealthy")
      assert httpx.post(router_url + "/generate", json={
          "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}).status_code == 503
      thread, out = _in_background(lambda: client.generate(
          [Request("through", (3, 4), 3)], SamplingParams(max_new_tokens=3)))
      time.sleep(2.0)
      httpx.post(url + "/continue_generation", json={})
      thread.join(60)
      assert "error" not in out, out.get("error")
      assert len(out["result"][0].token_ids) == 3
    finally:
      client.close()
      router.stop(router_process)


def test_every_control_call_has_a_deadline_naming_the_server_and_the_call(tiny_cfg,
                                                                          tiny_params,
                                                                          tmp_path):
  """A server that stops answering (SIGSTOP: alive, silent): a weight sync fails within
  control_timeout naming it and the call, while generation keeps its long read timeout."""
  path = hf.save(tiny_params, tiny_cfg, str(tmp_path / "v0"))
  process, url = launch(["--hf_checkpoint", path, "--dtype", "float32"])
  client = SGLangClient([url], retries=0, control_timeout=1.0)
  try:
    process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(ServerError, match=f"{url}/pause_generation .*TimeoutError"):
      client.sync_weights(path, 1)
    assert time.monotonic() - started < 10
  finally:
    client.close()
    process.send_signal(signal.SIGCONT)
    process.kill()
    process.wait()


def test_sampling_seed_is_honoured_only_with_deterministic_inference(tiny_cfg, tiny_params,
                                                                     monkeypatch, tmp_path):
  """Without --enable-deterministic-inference SGLang's sampler ignores sampling_seed; with
  it, a request without one samples from seed 42. A reproducible run (LONGRL_DETERMINISTIC=1,
  set by RLConfig.deterministic) refuses servers that would ignore its seeds."""
  def twice(url, seed):
    sampling = {"sampling_seed": seed} if seed is not None else {}
    return [_generate(url, f"s{i}-{seed}", 12, sampling=sampling).json()["output_ids"]
            for i in range(2)]

  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    assert twice(url, 7)[0] != twice(url, 7)[1]  # 12 tokens from a near-uniform model
    monkeypatch.setenv("LONGRL_DETERMINISTIC", "1")
    with pytest.raises(ServerError, match="enable-deterministic-inference"):
      remote_engine(tiny_cfg, tiny_params, 0, urls=[url], weights_dir="unused")
  with helpers.serving(tiny_cfg, tiny_params, deterministic=True) as (url, _):
    same = twice(url, 7)
    assert same[0] == same[1] and twice(url, None)[0] == twice(url, 42)[0]
    engine = remote_engine(tiny_cfg, tiny_params, 0, urls=[url], weights_dir=str(tmp_path))
    engine.close()


def test_exports_in_the_compute_dtype_and_auto_serves_float32_in_float16(tiny_cfg, tiny_params,
                                                                         tmp_path):
  """SGLang's --dtype auto serves a float32 checkpoint in float16: exports are in the model's
  compute dtype (bf16 for a pretrained model) unless export_dtype says otherwise, and
  local_engine starts its servers with that --dtype."""
  assert served_dtype({"torch_dtype": "float32"}, "auto") == "float16"
  assert served_dtype({}, "auto") == "float16"
  assert served_dtype({"torch_dtype": "float32", "model_type": "gemma2"}, "auto") == "bfloat16"
  assert served_dtype({"dtype": "bfloat16"}, "auto") == "bfloat16"
  assert served_dtype({"torch_dtype": "float32"}, "float32") == "float32"
  cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16")
  engine = SGLangEngine(SGLangClient(["http://127.0.0.1:9"]), cfg, weights_dir=str(tmp_path))
  try:
    path = engine.export(tiny_params, 1)
  finally:
    engine.close()
  with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  _, params = hf.load(path)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))


def test_held_requests_last_vocabulary_ids_and_empty_spans_as_sglang_has_them(tiny_cfg,
                                                                             tiny_params,
                                                                             tmp_path):
  """The smaller things SGLang does that a client meets: the abort of a request held by a
  pause is lost (it runs once let through); an input id >= vocab_size - 1 comes back as 0 in
  input_token_logprobs (teacher scoring copes); a response without tokens has one empty
  weight-version span."""
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    httpx.post(url + "/pause_generation", json={"mode": "in_place"})
    thread, out = _in_background(lambda: _generate(url, "held", 5).json())
    time.sleep(0.3)
    httpx.post(url + "/abort_request", json={"rid": "held"})
    httpx.post(url + "/continue_generation", json={})
    thread.join(60)
    assert out["result"]["meta_info"]["finish_reason"]["type"] == "length"
    last = tiny_cfg.vocab_size - 1
    reply = httpx.post(url + "/generate", json={
        "input_ids": [3, 17, last, 5], "return_logprob": True, "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 0}}).json()
    assert [e[1] for e in reply["meta_info"]["input_token_logprobs"]] == [17, 0, 5]
    assert reply["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 0}]
    engine = SGLangEngine(SGLangClient([url]), tiny_cfg, weights_dir=str(tmp_path))
    try:
      scores = engine.score([[3, 17]], [[last, 5]])[0]
    finally:
      engine.close()
    want = JaxEngine(tiny_cfg, tiny_params).score([[3, 17]], [[last, 5]])[0]
    np.testing.assert_allclose(scores, want, atol=1e-4)
