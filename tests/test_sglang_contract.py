"""One contract, two servers: every interaction of the SGLang client (rollouts/sglang.py) with
a server, each test body run against our server (rollouts/server/) and against the real
SGLang 0.5.23 started on this CPU (tests/real_sglang.py, installed by
scripts/setup_sglang.sh). Where they differed, ours was changed to SGLang's behaviour;
docs/sglang.md section 4 has the table.

Both serve the same tiny Qwen2 checkpoint (float32, no tokenizer files: token ids in and out,
SGLang with --skip-tokenizer-init) under an API key and an admin key, with a context length of
CONTEXT tokens; each is started once."""

import dataclasses
import subprocess
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from models import config, hf, transformer
from rl import ConfigError, sampling, sources
from rl.config import RLConfig
from rl.tasks.arithmetic import Arithmetic
from rollouts import router as router_lib
from rollouts.decoding import score_continuations, score_continuations_top_k
from rollouts.engine import SamplingParams
from rollouts.server.main import launch
from rollouts.sglang import Request, SGLangClient, ServerError
from rollouts.sglang_engine import SGLangEngine
from tests import real_sglang

pytestmark = pytest.mark.xdist_group("sglang_contract")

KEY, ADMIN = "contract-key", "contract-admin-key"
CONTEXT = 1024
PROMPTS = [[3, 17, 22, 9], [40, 41], [5] * 9]  # ids < the tiny vocabulary (55)


@dataclasses.dataclass
class Model:
  cfg: config.ModelConfig
  params: list  # v0, v1
  paths: list[str]  # their checkpoints


# Session-scoped, so that the tests of other modules that pytest-xdist interleaves with these
# on one worker do not stop and restart the servers.
@pytest.fixture(scope="session")
def model(tokenizer, tmp_path_factory) -> Model:
  cfg = config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=64)
  root = tmp_path_factory.mktemp("contract")
  params = [transformer.init_params(cfg, jax.random.PRNGKey(seed)) for seed in (0, 1)]
  return Model(cfg, params, [hf.save(p, cfg, str(root / f"v{i:06d}"))
                             for i, p in enumerate(params)])


@dataclasses.dataclass
class Served:
  """A server process of `kind` ("ours" or "sglang") at `url`; `stop()` stops it."""
  kind: str
  url: str
  stop: object


def start(kind: str, path: str, keys: bool = True, wait: bool = True) -> Served:
  """A server of `kind` on `path` (weight version 0, float32, CONTEXT; with `keys` KEY and
  ADMIN), up (`wait` False: SGLang's maybe still starting; ours is up either way)."""
  extra = ["--api-key", KEY, "--admin-api-key", ADMIN] if keys else []
  if kind == "ours":
    process, url = launch(["--hf_checkpoint", path, "--weight_version", "0", "--dtype",
                           "float32", "--context-length", str(CONTEXT), *extra])

    def stop():
      process.kill()
      process.wait(timeout=30)
    return Served(kind, url, stop)
  real = real_sglang.Server(path, context_length=CONTEXT, wait=wait,
                            extra=["--skip-tokenizer-init", "--weight-version", "0", *extra])
  return Served(kind, real.url, real.stop)


@pytest.fixture(scope="session", params=["ours", "sglang"])
def server(request, model):
  served = start(request.param, model.paths[0])
  yield served
  served.stop()


@pytest.fixture
def client(server):
  client = SGLangClient([server.url], api_key=KEY, admin_api_key=ADMIN, retries=1)
  yield client
  client.close()


def engine_on(client: SGLangClient, model: Model, tmp_path) -> SGLangEngine:
  return SGLangEngine(client, model.cfg, weights_dir=str(tmp_path), weights_path=model.paths[0],
                      context_length=client.context_length())


def call(client: SGLangClient, path: str, body: dict | None = None, method: str = "POST"):
  """A control call through the client (its keys, its deadline)."""
  return client._run(client._call(client._control, client.urls[0], method, path, body))


def running(url: str) -> int:
  reply = httpx.get(url + "/v1/loads", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
  return sum(load["num_running_reqs"] for load in reply.json()["loads"])


def wait_for(condition, what: str, seconds: float = 60.0) -> None:
  deadline = time.monotonic() + seconds
  while not condition():
    assert time.monotonic() < deadline, f"{what} within {seconds} s"
    time.sleep(0.02)


def in_background(function):
  """(thread, box): `function()` on a thread; box["value"] or box["error"] once it ends."""
  box = {}

  def run():
    try:
      box["value"] = function()
    except BaseException as e:  # noqa: BLE001 (handed to the test)
      box["error"] = e
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, box


def generate_raw(url: str, rid: str, prompt: list[int], max_new: int) -> httpx.Response:
  return httpx.post(url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                    json={"rid": rid, "input_ids": prompt, "return_logprob": True,
                          "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0,
                                              "ignore_eos": True}})


def trainer_logprobs(model: Model, version: int, prompts, continuations) -> list[np.ndarray]:
  return score_continuations(model.params[version], model.cfg, prompts,
                             [list(c) for c in continuations])


def test_generated_logprobs_are_the_trainers(model, client, tmp_path):
  """Sampled at temperature 1 the log-probs are the trainer's (float32 on both sides); greedy
  picks a most likely token at every step."""
  engine = engine_on(client, model, tmp_path)
  for temperature in (1.0, 0.0):
    made = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature),
                           seed=0)
    for prompt, completion in zip(PROMPTS, made):
      assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
      assert set(completion.versions.tolist()) == {0}
      want = trainer_logprobs(model, 0, [prompt], [completion.token_ids])[0]
      if temperature:
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)
      else:  # each token within 1e-4 of the best one the trainer sees there
        best = score_continuations_top_k(model.params[0], model.cfg, [prompt],
                                         [list(completion.token_ids)], 1)[0][2][:, 0]
        assert np.all(want >= best - 1e-4), (want, best)


def test_scoring_with_top_logprobs_from_logprob_start_len(model, client, tmp_path):
  """Teachers' path: a continuation's log-probs and the top-k at each of its positions, asked
  from logprob_start_len = the position before it (SGLang's entry there is null)."""
  engine = engine_on(client, model, tmp_path)
  continuations = [[7, 8, 9, 10], [11], [20, 21, 22]]
  scored = engine.score_top_k(PROMPTS, continuations, 3)
  want = score_continuations_top_k(model.params[0], model.cfg, PROMPTS, continuations, 3)
  for (logprobs, ids, top), (want_lp, want_ids, want_top) in zip(scored, want):
    np.testing.assert_allclose(logprobs, want_lp, atol=1e-4)
    np.testing.assert_allclose(top, want_top, atol=1e-4)
    # A token is the trainer's k-th where the two are not a near-tie.
    clear = np.abs(np.diff(want_top, axis=1, append=-np.inf)) > 1e-3
    assert np.all((ids == want_ids) | ~clear)
  plain = engine.score(PROMPTS, continuations)
  for a, (b, *_) in zip(plain, scored):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_stop_aborts_the_rest_by_rid_and_they_return_what_they_made(model, client):
  """Partial rollouts: once stop_when says stop, the requests still running come back
  "abort" with the tokens made so far (their log-probs the trainer's); an abort of an
  unknown rid or of a prefix of a live one does nothing."""
  long_rid = "contract-abort-long"
  thread, box = in_background(lambda: generate_raw(client.urls[0], long_rid, [1, 2, 3], 900))
  wait_for(lambda: running(client.urls[0]) >= 1, "the long request running")
  for rid in ("contract-abort", "no-such-rid"):  # a prefix of a live rid, an unknown one
    call(client, "/abort_request", {"rid": rid})
  time.sleep(0.3)
  assert thread.is_alive(), "an abort that should do nothing ended the request"
  call(client, "/abort_request", {"rid": long_rid})
  thread.join(60)
  reply = box["value"].json()
  assert reply["meta_info"]["finish_reason"]["type"] == "abort"
  made = len(reply["output_ids"])
  assert 0 < made < 900

  requests = [Request(rid="contract-stop-0", input_ids=(4, 5, 6), max_new_tokens=1),
              Request(rid="contract-stop-1", input_ids=(7, 8, 9), max_new_tokens=900)]
  out = client.generate(requests, SamplingParams(max_new_tokens=900, temperature=1.0),
                        stop_when=lambda index, completion: index == 0)
  assert out[0].finish_reason == "length" and len(out[0].token_ids) == 1
  assert out[1].finish_reason == "abort" and len(out[1].token_ids) < 900
  if len(out[1].token_ids):
    want = trainer_logprobs(model, 0, [[7, 8, 9]], [out[1].token_ids])[0]
    np.testing.assert_allclose(out[1].logprobs, want, atol=1e-4)


def test_a_live_rid_is_refused_as_a_duplicate(client):
  thread, box = in_background(lambda: generate_raw(client.urls[0], "contract-dup", [1, 2],
                                                   900))
  wait_for(lambda: running(client.urls[0]) >= 1, "the first request running")
  second = generate_raw(client.urls[0], "contract-dup", [1, 2], 4)
  assert second.status_code == 400
  assert "Duplicate request ID detected" in second.json()["error"]["message"]
  call(client, "/abort_request", {"rid": "contract-dup"})
  thread.join(60)
  assert box["value"].status_code == 200


def test_pause_aborts_what_runs_and_holds_what_comes_until_continue(client):
  thread, box = in_background(lambda: generate_raw(client.urls[0], "contract-paused", [1],
                                                   900))
  wait_for(lambda: running(client.urls[0]) >= 1, "the request running")
  paused = call(client, "/pause_generation", {"mode": "abort"})
  assert paused == {"message": "Generation paused successfully.", "status": "ok"}
  thread.join(60)
  assert box["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"
  held, box = in_background(lambda: generate_raw(client.urls[0], "contract-held", [1, 2], 3))
  time.sleep(1.5)
  assert held.is_alive(), "a request ran while the server was paused"
  assert call(client, "/continue_generation", {}) == {
      "message": "Generation continued successfully.", "status": "ok"}
  held.join(60)
  assert len(box["value"].json()["output_ids"]) == 3


def test_health_waits_while_paused_and_a_bounded_wait_names_the_server(client):
  """/health generates a token, so it does not answer 200 while paused (nor while a server
  starts); the client's wait for it is bounded and names the server."""
  client.check_health(60)
  call(client, "/pause_generation", {"mode": "abort"})
  try:
    began = time.monotonic()
    with pytest.raises(ServerError, match=f"{client.urls[0]}.*"):
      client.check_health(3)
    assert time.monotonic() - began < 15
  finally:
    call(client, "/continue_generation", {})
  client.check_health(60)


def test_a_weight_update_from_disk_changes_the_outputs_and_the_version(model, client,
                                                                        tmp_path):
  engine = engine_on(client, model, tmp_path)
  try:
    client.sync_weights(model.paths[1], 1)
    assert client.model_info()[client.urls[0]]["weight_version"] == "1"
    made = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0), seed=1)
    for prompt, completion in zip(PROMPTS, made):
      assert set(completion.versions.tolist()) == {1}
      np.testing.assert_allclose(
          completion.logprobs, trainer_logprobs(model, 1, [prompt], [completion.token_ids])[0],
          atol=1e-4)
  finally:
    client.sync_weights(model.paths[0], 0)
  assert client.model_info()[client.urls[0]]["weight_version"] == "0"


# Ours only: SGLang 0.5.23 on a CPU goes down at /release_memory_occupation, which
# synchronizes CUDA after releasing (scheduler_components/weight_updater.py L379: "Found no
# NVIDIA driver"); bench/gpu_sglang_checks.py runs this turn against it on a GPU.
@pytest.mark.parametrize("server", ["ours"], indirect=True)
def test_release_and_resume_around_a_weight_update(model, client):
  """The hybrid deployment's turn: pause, release everything, take the weights back, load,
  take the KV cache back, continue. (Without --enable-memory-saver our server frees nothing,
  as SGLang's memory saver adapter is then a no-op.)"""
  try:
    client.release_memory()
    client.sync_weights(model.paths[1], 1)
    made = client.generate([Request(rid="contract-released", input_ids=(3, 4), max_new_tokens=4)],
                           SamplingParams(max_new_tokens=4, temperature=1.0))[0]
    assert len(made.token_ids) == 4 and set(made.versions.tolist()) == {1}
    np.testing.assert_allclose(
        made.logprobs, trainer_logprobs(model, 1, [[3, 4]], [made.token_ids])[0], atol=1e-4)
  finally:
    client.sync_weights(model.paths[0], 0)


def test_model_and_server_info_hold_what_the_client_reads(client):
  model_info = client.model_info()[client.urls[0]]
  assert model_info["weight_version"] == "0"
  info = call(client, "/server_info", method="GET")
  assert info["context_length"] == CONTEXT
  assert info["enable_memory_saver"] is False and info["enable_deterministic_inference"] is False
  assert client.context_length() == CONTEXT


def test_the_context_length_is_read_refused_in_one_line_and_answered_as_sglang(model, client,
                                                                              tmp_path):
  engine = engine_on(client, model, tmp_path)
  assert engine.capabilities.context_length == CONTEXT
  task = Arithmetic(num_train=8, num_test=4)
  context = sources.Context(engine, task, None, RLConfig(seq_len=CONTEXT), sampling.uniform())
  with pytest.raises(ConfigError, match=f"above the servers' context length of {CONTEXT}"):
    sources.check(sources.Lockstep(), context)
  sources.check(sources.Lockstep(), dataclasses.replace(context,
                                                        config=RLConfig(seq_len=CONTEXT - 1)))
  over = generate_raw(client.urls[0], "contract-long", [1] * 10, CONTEXT - 9)
  assert over.status_code == 400
  assert over.json()["error"]["message"].startswith(
      f"Requested token count exceeds the model's maximum context length of {CONTEXT} "
      f"tokens. You requested a total of {CONTEXT + 1} tokens: 10 tokens from the input")
  longer = generate_raw(client.urls[0], "contract-longer", [1] * CONTEXT, 1)
  assert longer.json()["error"]["message"] == (
      f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} "
      "tokens).")
  assert generate_raw(client.urls[0], "contract-fits", [1] * 10, CONTEXT - 10).status_code == 200


def test_keys_guard_generation_and_control_as_sglangs(client):
  url = client.urls[0]
  assert httpx.get(url + "/health", timeout=60).status_code == 200  # no key needed
  no_key = httpx.post(url + "/generate", json={"input_ids": [1], "sampling_params": {
      "max_new_tokens": 1}}, timeout=60)
  assert no_key.status_code == 401 and no_key.json() == {"error": "Unauthorized"}
  # The API key opens generation, not the control calls once there is an admin key.
  user = SGLangClient([url], api_key=KEY, retries=0)
  try:
    user.generate([Request(rid="contract-user", input_ids=(1, 2), max_new_tokens=2)],
                  SamplingParams(max_new_tokens=2))
    with pytest.raises(ServerError, match="HTTP 401"):
      user._run(user._each("POST", "/continue_generation", {}))
  finally:
    user.close()
  admin_only = httpx.post(url + "/generate", headers={"Authorization": f"Bearer {ADMIN}"},
                          json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
                          timeout=60)
  assert admin_only.status_code == 401  # the API key is what generation needs


@pytest.mark.slow
def test_two_servers_behind_the_router_generate_and_take_weights(model, server):
  """Two servers of the kind, started together and waited for by the client (bounded), then
  sglang-router in front of them (without keys: the router would have to pass them on):
  generation routed, a weight sync to both, then every token at the new version."""
  fleet = []
  try:
    for _ in range(2):  # started together, from this thread (real_sglang.Server)
      fleet.append(start(server.kind, model.paths[0], keys=False, wait=False))
    # The client waits out servers still starting (refused connections, then SGLang's 503s).
    waiting = SGLangClient([served.url for served in fleet])
    try:
      waiting.check_health(300)
    finally:
      waiting.close()
    routed(model, [served.url for served in fleet])
  finally:
    for served in fleet:
      served.stop()


def routed(model: Model, urls: list[str]) -> None:
  router_process, router_url = router_lib.launch(urls)
  client = SGLangClient(urls, router=router_url)
  try:
    requests = [Request(rid=f"routed-{i}", input_ids=tuple(p), max_new_tokens=6, affinity=i)
                for i, p in enumerate(PROMPTS * 2)]
    made = client.generate(requests, SamplingParams(max_new_tokens=6, temperature=1.0))
    assert all(len(c.token_ids) == 6 and set(c.versions.tolist()) == {0} for c in made)
    client.sync_weights(model.paths[1], 1)
    assert {i["weight_version"] for i in client.model_info().values()} == {"1"}
    made = client.generate([dataclasses.replace(r, rid=r.rid + "-v1") for r in requests],
                           SamplingParams(max_new_tokens=6, temperature=1.0))
    assert all(set(c.versions.tolist()) == {1} for c in made)
    client.sync_weights(model.paths[0], 0)
  finally:
    client.close()
    router_process.terminate()
    try:
      router_process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      router_process.kill()
