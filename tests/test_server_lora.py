"""Our server's LoRA adapters (rollouts/server/adapters.py) against what SGLang 0.5.23 does
(its lines cited there): loads and unloads with SGLang's bodies, status codes and messages;
requests naming an adapter (one for all, or one per prompt) computed with the base plus
alpha / r A B, for a dense model and a mixture's experts; a name loaded once reloaded by a
request after its unload; unload waiting for the requests using it; the least recently used
adapter evicted past --max-loaded-loras, a pinned one never; every load a prefix cache of its
own; the start-up checks of SGLang's flags."""

import json
import os
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import pytest

from models import config, hf_lora, lora, transformer
from models.config import MoeConfig
from models.lora import LoraConfig
from rollouts.server import main
from tests import helpers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"max_rank": 8, "targets": TARGETS}
PROMPT = [3, 17, 22, 5]
OK = {"rid": None, "http_worker_ipc": None, "success": True, "error_message": ""}


def _adapter_dir(cfg, params, path, *, key=1, rank=4, **config_changes):
  """A PEFT directory of adapters for `params`, their B moved off zero (so they matter)."""
  lora_cfg = LoraConfig(rank=rank, alpha=2.0 * rank)
  adapters = lora.init_adapters(params, lora_cfg, cfg, jax.random.PRNGKey(key))
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(key + 100), len(leaves))
  adapters = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
  hf_lora.save_adapter(adapters, cfg, lora_cfg, str(path))
  if config_changes:
    with open(path / hf_lora.CONFIG) as f:
      written = json.load(f)
    with open(path / hf_lora.CONFIG, "w") as f:
      json.dump({**written, **config_changes}, f)
  return str(path), adapters


def _greedy(url, lora_path=None, prompts=(PROMPT,), max_new=8):
  body = {"input_ids": [list(p) for p in prompts], "return_logprob": True,
          "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
  if lora_path is not None:
    body["lora_path"] = lora_path
  return httpx.post(url + "/generate", json=body, timeout=120)


def _tokens(reply) -> list[list[int]]:
  assert reply.status_code == 200, reply.text
  return [r["output_ids"] for r in reply.json()]


def _post(url, path, **body):
  return httpx.post(url + path, json=body, timeout=120)


def test_an_adapter_is_loaded_named_by_requests_unloaded_and_reloaded_as_sglang_does(
    tiny_cfg, tiny_params, tmp_path):
  """Load: 200 and the adapters held, /v1/models lists it; a second load of the name is
  refused. A request naming it is computed with the merged weights (the output of a server
  serving W + alpha / r A B), one with a list per prompt (null: the base); nothing about the
  adapter in meta_info. Unload: 200; a request naming it afterwards loads it again from its
  path (SGLang's implicit reload), so that a load of the name is then refused; a name never
  loaded and an unknown unload are refused with SGLang's messages."""
  path, adapters = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "a")
  merged = lora.merge(lora.attach(tiny_params, adapters))
  with helpers.serving(tiny_cfg, merged) as (merged_url, _):
    want = _tokens(_greedy(merged_url))[0]
  with helpers.serving(tiny_cfg, tiny_params, lora=LORA) as (url, _):
    base = _tokens(_greedy(url))[0]
    assert base != want  # the adapter matters here
    loaded = _post(url, "/load_lora_adapter", lora_name="a-v1", lora_path=path)
    assert (loaded.status_code, loaded.json()) == (200, {**OK, "loaded_adapters": {
        "a-v1": path}})
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [("a-v1", path,
                                                                       "longrl")]
    again = _post(url, "/load_lora_adapter", lora_name="a-v1", lora_path=path)
    assert again.status_code == 400 and again.json()["error_message"] == (
        "Failed to load LoRA adapter a-v1 because it is already loaded")
    reply = _greedy(url, "a-v1")
    assert _tokens(reply) == [want]
    assert not any("lora" in key for key in reply.json()[0]["meta_info"])
    assert _tokens(_greedy(url, [None, "a-v1", "a-v1"], [PROMPT] * 3)) == [base, want, want]
    never = _greedy(url, "b")
    assert never.status_code == 400 and never.json()["error"]["message"] == (
        "Got LoRA adapter that has never been loaded: b\n"
        "All loaded adapters: dict_keys(['a-v1']).")
    unloaded = _post(url, "/unload_lora_adapter", lora_name="a-v1")
    assert (unloaded.status_code, unloaded.json()) == (200, {**OK, "loaded_adapters": {}})
    unknown = _post(url, "/unload_lora_adapter", lora_name="a-v1")
    assert unknown.status_code == 400 and unknown.json()["error_message"] == (
        "LoRA with name a-v1 does not exist. Loaded LoRAs: odict_keys([])")
    assert _tokens(_greedy(url, "a-v1")) == [want]  # reloaded from its path
    assert _post(url, "/load_lora_adapter", lora_name="a-v1",
                 lora_path=path).json()["error_message"].endswith("it is already loaded")


def test_a_mixtures_experts_are_served_with_their_adapters(tmp_path):
  """Routed experts (one adapter each, rank // experts, zero-padded in the PEFT directory)
  and the shared expert: the server's output is the merged weights' output."""
  cfg = config.tiny(64, hidden_size=32, intermediate_size=48,
                    moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=24,
                                  shared_size=16))
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  path, adapters = _adapter_dir(cfg, params, tmp_path / "moe", rank=8)
  # (A context length given: no config.json says this mixture's shared expert.)
  with helpers.serving(cfg, lora.merge(lora.attach(params, adapters)),
                       context_length=512) as (url, _):
    want = _tokens(_greedy(url))
  with helpers.serving(cfg, params, lora=LORA, context_length=512) as (url, _):
    base = _tokens(_greedy(url))
    assert _post(url, "/load_lora_adapter", lora_name="moe", lora_path=path).status_code == 200
    assert _tokens(_greedy(url, "moe")) == want != base


def test_loads_that_cannot_be_served_are_refused_with_sglangs_messages(tiny_cfg, tiny_params,
                                                                        tmp_path):
  """Rank above --max-lora-rank and a target outside --lora-target-modules (one message for
  both), DoRA, a missing directory, no adapter_config.json, no weights, a missing field; LoRA
  off: every call refused, and a request naming an adapter."""
  wide, _ = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "wide", rank=16)
  dora, _ = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "dora", use_dora=True)
  (tmp_path / "empty").mkdir()
  (tmp_path / "no_weights").mkdir()
  (tmp_path / "no_weights" / hf_lora.CONFIG).write_text(
      '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
  incompatible = ("LoRA adapter {} with rank {} is incompatible with the current LoRA memory "
                  "pool configuration. Please ensure that the LoRA adapter's rank is within "
                  "the configured `--max-lora-rank` and that the target modules are included "
                  "in `--lora-target-modules`.")
  narrow = {"max_rank": 8, "targets": ["q_proj", "v_proj"]}
  cases = [
      (LORA, "wide", wide, incompatible.format("wide", 16)),
      (narrow, "all", _adapter_dir(tiny_cfg, tiny_params, tmp_path / "all")[0],
       incompatible.format("all", 4)),
      (LORA, "dora", dora, "Failed to load dora because LoRA serving currently doesn't "
       "support DoRA adapters"),
      (LORA, "gone", "/no/such/dir", "Repo id must be in the form 'repo_name' or "
       "'namespace/repo_name': '/no/such/dir'. Use `repo_type` argument if needed."),
      (LORA, "empty", str(tmp_path / "empty"), "[Errno 2] No such file or directory: "
       f"'{tmp_path / 'empty' / hf_lora.CONFIG}'"),
      (LORA, "none", str(tmp_path / "no_weights"),
       f"Cannot find any model weights with `{tmp_path / 'no_weights'}`")]
  for options in (LORA, narrow):
    with helpers.serving(tiny_cfg, tiny_params, lora=options) as (url, _):
      for case_options, name, path, message in cases:
        if case_options is options:
          reply = _post(url, "/load_lora_adapter", lora_name=name, lora_path=path)
          assert reply.status_code == 400, (name, reply.text)
          assert reply.json() == {**OK, "success": False, "error_message": message,
                                  "loaded_adapters": {}}, name
      missing = _post(url, "/load_lora_adapter", lora_name="x")
      assert missing.status_code == 400 and missing.json()["type"] == "Bad Request"
  with helpers.serving(tiny_cfg, tiny_params) as (url, _):
    off = _post(url, "/load_lora_adapter", lora_name="a", lora_path=wide)
    assert off.status_code == 400 and off.json()["error_message"] == (
        "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    assert off.json()["loaded_adapters"] is None
    named = _greedy(url, "a")
    assert named.status_code == 400 and named.json()["error"]["message"].startswith(
        "LoRA adapter 'a' was requested, but LoRA is not enabled.")
    assert httpx.get(url + "/server_info").json()["enable_lora"] is False


def _in_background(function):
  out = {}
  thread = threading.Thread(target=lambda: out.setdefault("result", function()), daemon=True)
  thread.start()
  return thread, out


def _frozen_mid_generation(url, scheduler, rid: str, lora_path: str):
  """A long request on `lora_path`, paused in place once it has made two tokens (it stays in
  flight until aborted): its thread and where its reply will be."""
  thread, out = _in_background(lambda: httpx.post(url + "/generate", timeout=120, json={
      "rid": rid, "input_ids": PROMPT, "lora_path": lora_path,
      "sampling_params": {"max_new_tokens": 400, "temperature": 0.0}}))
  deadline = time.monotonic() + 60
  while not any(len(r.tokens) >= 2 for r in list(scheduler.running)):
    assert time.monotonic() < deadline and thread.is_alive(), "it never ran"
    time.sleep(0.002)
  _post(url, "/pause_generation", mode="in_place")
  return thread, out


def test_an_unload_waits_for_the_requests_using_the_adapter(tiny_cfg, tiny_params, tmp_path):
  """The unload unregisters the name at once and returns only once the request using the
  adapter has ended (here aborted)."""
  path, _ = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "a")
  with helpers.serving(tiny_cfg, tiny_params, lora=LORA) as (url, scheduler):
    _post(url, "/load_lora_adapter", lora_name="a", lora_path=path)
    request, answered = _frozen_mid_generation(url, scheduler, "long", "a")
    unload, unloaded = _in_background(lambda: _post(url, "/unload_lora_adapter",
                                                    lora_name="a"))
    unload.join(1.0)
    assert unload.is_alive() and "a" not in scheduler.adapters.loaded()  # unregistered, waiting
    _post(url, "/abort_request", rid="long")
    for thread in (request, unload):
      thread.join(60)
      assert not thread.is_alive()
    assert answered["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert unloaded["result"].json() == {**OK, "loaded_adapters": {}}
    _post(url, "/continue_generation")
    assert _greedy(url).status_code == 200


def test_past_max_loaded_loras_the_least_recently_used_unpinned_adapter_is_evicted(
    tiny_cfg, tiny_params, tmp_path):
  """With --max-loaded-loras 2: a request naming an adapter makes it the most recent, a
  third load evicts the least recent one that is not pinned, and a request naming more
  adapters than that is refused."""
  paths = {name: _adapter_dir(tiny_cfg, tiny_params, tmp_path / name, key=k)[0]
           for k, name in enumerate("abcd", start=1)}
  with helpers.serving(tiny_cfg, tiny_params, lora={**LORA, "max_loaded": 2}) as (url, _):
    for name in "ab":
      _post(url, "/load_lora_adapter", lora_name=name, lora_path=paths[name],
            pinned=name == "a")
    _tokens(_greedy(url, "a"))
    assert set(_post(url, "/load_lora_adapter", lora_name="c",
                     lora_path=paths["c"]).json()["loaded_adapters"]) == {"a", "c"}
    _tokens(_greedy(url, "c"))  # c the most recent: a is still kept, being pinned
    assert set(_post(url, "/load_lora_adapter", lora_name="d",
                     lora_path=paths["d"]).json()["loaded_adapters"]) == {"a", "d"}
    many = _greedy(url, ["a", "c", "d"], [PROMPT] * 3)
    assert many.status_code == 400 and many.json()["error"]["message"] == (
        "Received request with 3 unique loras requested but max loaded loras is 2")


def test_every_load_is_a_prefix_cache_of_its_own(tiny_cfg, tiny_params, tmp_path):
  """An aborted request's keys and values serve its resumption under the same load of the
  adapter, not under the same adapter loaded again under another name (a fresh id) nor the
  base."""
  path, _ = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "a")
  with helpers.serving(tiny_cfg, tiny_params, lora=LORA) as (url, scheduler):
    for name in ("v1", "v2"):
      _post(url, "/load_lora_adapter", lora_name=name, lora_path=path)
    request, answered = _frozen_mid_generation(url, scheduler, "cut", "v1")
    _post(url, "/abort_request", rid="cut")
    request.join(60)
    _post(url, "/continue_generation")
    cut = answered["result"].json()
    resumed = PROMPT + cut["output_ids"]
    for name, cached in (("v2", 0), (None, 0), ("v1", len(resumed))):
      body = {"input_ids": resumed, "sampling_params": {"max_new_tokens": 4,
                                                          "temperature": 0.0}}
      reply = httpx.post(url + "/generate", timeout=120,
                         json={**body, **({"lora_path": name} if name else {})}).json()
      assert reply["meta_info"]["cached_tokens"] == cached, name


def test_the_command_line_checks_sglangs_lora_flags(tiny_cfg, tiny_params, tmp_path):
  """--enable-lora needs --max-lora-rank and --lora-target-modules unless --lora-paths gives
  adapters (then their largest rank and their targets); 'all' stands alone; --lora-paths
  turns LoRA on and /server_info reports the start-up adapters."""
  parser = main._parser()
  with pytest.raises(SystemExit):
    main._lora_options(parser, parser.parse_args(["--enable-lora", "--max-lora-rank", "8"]))
  with pytest.raises(SystemExit):
    main._lora_options(parser, parser.parse_args([
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"]))
  assert main._lora_options(parser, parser.parse_args([])) == (None, {})
  path, _ = _adapter_dir(tiny_cfg, tiny_params, tmp_path / "a")
  lora_options, paths = main._lora_options(parser, parser.parse_args(["--lora-paths",
                                                                      f"a={path}"]))
  assert lora_options == {"max_rank": 4, "targets": sorted(TARGETS), "max_loaded": None,
                          "max_per_batch": 8} and paths == {"a": path}
  with helpers.serving(tiny_cfg, tiny_params, lora=lora_options, lora_paths=paths) as (url, _):
    info = httpx.get(url + "/server_info").json()
    assert (info["enable_lora"], info["max_lora_rank"], info["max_loras_per_batch"]) == (
        True, 4, 8)
    assert [(p["lora_name"], p["lora_path"]) for p in info["lora_paths"]] == [("a", path)]
    assert _greedy(url, "a").status_code == 200



def test_the_engine_syncs_adapters_alone_and_every_request_names_its_version(
    tiny_cfg, tiny_params, tmp_path):
  """SGLangEngine.update_adapters: the base once, then each version's adapters as a PEFT
  directory loaded under a name of its own; every request of a generate names the newest,
  its tokens are tagged with that version and are the merged weights' tokens; the two
  newest stay loaded, older ones are unloaded and their directories removed."""
  from rollouts.engine import SamplingParams
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  lora_cfg = LoraConfig(rank=4, alpha=8.0)
  versions = {}
  for version in (1, 2, 3):
    _, versions[version] = _adapter_dir(tiny_cfg, tiny_params, tmp_path / f"made{version}",
                                        key=version)
  base = transformer.init_params(tiny_cfg, jax.random.PRNGKey(7))  # not what servers start on
  greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
  with helpers.serving(tiny_cfg, lora.merge(lora.attach(base, versions[3]))) as (url, _):
    want = _tokens(_greedy(url, prompts=[PROMPT, PROMPT[:2]]))
  with helpers.serving(tiny_cfg, tiny_params, lora=LORA) as (url, scheduler):
    named = []
    submit = scheduler.submit

    def recording(requests):
      named.extend(None if r.adapter is None else r.adapter.name for r in requests)
      return submit(requests)

    scheduler.submit = recording
    engine = SGLangEngine(SGLangClient([url]), tiny_cfg, weights_dir=str(tmp_path / "w"),
                          rid_prefix="run", export_dtype="float32")
    try:
      bases = []
      for version in (1, 2, 3):
        engine.update_adapters(versions[version], lora_cfg, version,
                               base=lambda: bases.append(1) or base)
        out = engine.generate([PROMPT, PROMPT[:2]], greedy, seed=0)
      assert bases == [1]  # the base went once
      assert [c.token_ids.tolist() for c in out] == want
      assert all((c.versions == 3).all() for c in out)
      assert named == ["run-v1"] * 2 + ["run-v2"] * 2 + ["run-v3"] * 2
      assert set(scheduler.adapters.loaded()) == {"run-v2", "run-v3"}
      assert sorted(d for d in os.listdir(tmp_path / "w") if d.startswith("a")) == [
          "a000002", "a000003"]
    finally:
      engine.close()


def test_a_rollout_resumed_across_adapter_versions_keeps_each_tokens_version(
    tiny_cfg, tiny_params, tmp_path):
  """A partial rollout begun under adapter version 1 and resumed after the sync to version 2
  (its prompt and tokens so far sent again, as rl/envs/driver.py resumes one): the first
  tokens are tagged 1 and their log-probs are version 1's merged weights', the rest tagged 2
  and version 2's."""
  import numpy as np
  from rollouts.engine import SamplingParams
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  lora_cfg = LoraConfig(rank=4, alpha=8.0)
  versions = {v: _adapter_dir(tiny_cfg, tiny_params, tmp_path / f"made{v}", key=v)[1]
              for v in (1, 2)}
  sampled = SamplingParams(max_new_tokens=6, temperature=1.0)
  with helpers.serving(tiny_cfg, tiny_params, lora=LORA) as (url, _):
    engine = SGLangEngine(SGLangClient([url]), tiny_cfg, weights_dir=str(tmp_path / "w"),
                          rid_prefix="run", export_dtype="float32")
    try:
      engine.update_adapters(versions[1], lora_cfg, 1, base=lambda: tiny_params)
      (first,) = engine.generate([PROMPT], sampled, seed=0, max_new_tokens=[3])
      engine.update_adapters(versions[2], lora_cfg, 2, base=lambda: tiny_params)
      (rest,) = engine.generate([PROMPT + first.token_ids.tolist()], sampled, seed=1)
    finally:
      engine.close()
  assert first.versions.tolist() == [1] * 3 and rest.versions.tolist() == [2] * 6
  ids = jnp.asarray([PROMPT + first.token_ids.tolist() + rest.token_ids.tolist()])
  rows = (ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids))
  targets = np.asarray(ids[0, len(PROMPT):])
  logp = {}
  for version in (1, 2):
    params = lora.merged(tiny_params, versions[version])
    logits = transformer.forward(params, tiny_cfg, *rows) @ transformer.output_projection(
        params, tiny_cfg)
    scores = jax.nn.log_softmax(logits[0, len(PROMPT) - 1:-1])
    logp[version] = np.asarray(scores[np.arange(len(targets)), targets])
  np.testing.assert_allclose(first.logprobs, logp[1][:3], atol=1e-4)
  np.testing.assert_allclose(rest.logprobs, logp[2][3:], atol=1e-4)
  # The versions differ where they are told apart.
  assert np.abs(logp[1][:3] - logp[2][:3]).max() > 1e-2
  assert np.abs(logp[1][3:] - logp[2][3:]).max() > 1e-2
