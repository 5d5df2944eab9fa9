"""Checks of rollouts/sglang.py against a real SGLang server; run by bench/gpu_sglang_e2e.sh.

  python bench/gpu_sglang_checks.py URL WEIGHTS_DIR API_TYPES_PY
  python bench/gpu_sglang_checks.py --refit fp8|int4 URL WEIGHTS_DIR
  python bench/gpu_sglang_checks.py --lora URL WEIGHTS_DIR

The second: a server started from WEIGHTS_DIR/v000000, a quantized export, is refit with
WEIGHTS_DIR/v000001 (refit_check). The third: a LoRA run's syncs on a server started from
WEIGHTS_DIR/v000000 with --enable-lora (lora_check).

WEIGHTS_DIR holds v000000 (what the server was started with) and v000001 (other weights),
both tiny random Qwen2 checkpoints in bf16 written by the script (the server runs --dtype
bfloat16). Checks, each timed: the contract, sampled and greedy log-probs against the trainer's,
teacher scoring (SGLang's null entry at logprob_start_len), a partial rollout whose token
budget holds through aborts by exact rid, a refit, a hybrid release and resume (the server
runs --enable-memory-saver; nvidia-smi's memory in use at each point), and the same through
the real sglang-router (from .venv's test extra). Prints one line per check and exits
non-zero if any fails.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models import hf, lora  # noqa: E402
from rl.packing import trajectory_batch  # noqa: E402
from rl.train_step import policy_logprobs  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402
from rollouts.sglang import Request, SGLangClient, request_body  # noqa: E402
from rollouts.sglang_engine import SGLangEngine  # noqa: E402

# GPU kernels (bf16 matmuls, other reductions) are not bit-equal to XLA on CPU, and the
# weights are bf16 on both sides.
LOGPROB_ATOL = 5e-2
PROMPTS = [[11, 12, 13, 14], [200, 201], [7] * 9]


def _gpu_mib(field: str) -> int:
  """nvidia-smi's `field` (memory.used, memory.total) of GPU 0 in MiB: what the driver sees."""
  return int(subprocess.check_output(["nvidia-smi", f"--query-gpu={field}",
                                      "--format=csv,noheader,nounits"]).split()[0])


def main(url, weights_dir, api_types_path):
  spec = importlib.util.spec_from_file_location("api_types", api_types_path)
  api = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(api)
  v0, v1 = (os.path.join(weights_dir, f"v{i:06d}") for i in (0, 1))
  cfg, params0 = hf.load(v0, dtype="bfloat16", param_dtype="bfloat16")
  _, params1 = hf.load(v1, dtype="bfloat16", param_dtype="bfloat16")
  client = SGLangClient([url])
  client.check_health()
  failures = []

  def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
      failures.append(name)

  # Contract: our request and the server's response validate against sglang's own types.
  greedy = SamplingParams(32, temperature=0.0)
  body = request_body(Request("contract-1", tuple(PROMPTS[0]), 32), greedy)
  api.GenerateRequest.from_json_value(body)
  api.SamplingParams.from_json_value(body["sampling_params"])
  reply = httpx.post(url + "/generate", json=body, timeout=300).json()
  try:
    api.GenerateResponse.from_json_value(reply)
    check("contract", True)
  except api.JsonContractError as e:
    check("contract", False, str(e))

  # Log-prob parity: greedy tokens and log-probs vs the JAX engine; sampled log-probs vs the
  # trainer's recomputation on the same tokens.
  remote = client.generate([Request(f"parity-{i}", tuple(p), 32) for i, p in
                            enumerate(PROMPTS)], greedy)
  local = JaxEngine(cfg, params0).generate(PROMPTS, greedy, seed=0)
  same = [r.token_ids.tolist() == l.token_ids.tolist() for r, l in zip(remote, local)]
  check("greedy tokens equal the JAX engine's", all(same), str(same))
  sampled = client.generate([Request(f"samp-{i}", tuple(p), 32, sampling_seed=i)
                             for i, p in enumerate(PROMPTS * 4)], SamplingParams(32))
  batch, _ = trajectory_batch(PROMPTS * 4, [c.token_ids for c in sampled],
                              [c.logprobs for c in sampled], [0.0] * 12, [True] * 12, 128)
  trainer = np.asarray(jax.jit(policy_logprobs, static_argnums=1)(
      params0, cfg, jax.tree.map(jnp.asarray, batch))[0])
  diff = np.abs(trainer - batch.old_logp)[batch.loss_mask > 0]
  check("sampled log-probs equal the trainer's", diff.max() < LOGPROB_ATOL,
        f"mean {diff.mean():.2e} max {diff.max():.2e}")

  # Refit: pause, update_weights_from_disk, continue; version and outputs change.
  seconds = client.sync_weights(v1, 1)
  info = client.model_info()[url]
  after = client.generate([Request(f"refit-{i}", tuple(p), 32) for i, p in
                           enumerate(PROMPTS)], greedy)
  expected = JaxEngine(cfg, params1).generate(PROMPTS, greedy, seed=0)
  check("refit", info.get("weight_version") == "1" and
        [a.token_ids.tolist() for a in after] == [e.token_ids.tolist() for e in expected] and
        all(set(a.versions.tolist()) == {1} for a in after), f"{seconds:.2f} s")

  # Teacher scoring: SGLang's prompt log-probs (asked from the token before the first scored
  # one: its entry is null) equal the trainer's.
  engine = SGLangEngine(client, cfg, weights_dir=weights_dir, version=1)
  continuations = [a.token_ids.tolist() for a in after]
  started = time.perf_counter()
  scored = engine.score(PROMPTS, continuations)
  seconds = time.perf_counter() - started
  batch, placements = trajectory_batch(PROMPTS, continuations,
                                       [np.zeros(len(c)) for c in continuations],
                                       [0.0] * 3, [True] * 3, 128)
  trainer = np.asarray(jax.jit(policy_logprobs, static_argnums=1)(
      params1, cfg, jax.tree.map(jnp.asarray, batch))[0])
  # Position t of a row holds the log-prob of the token at t + 1 (tests/test_distill.py).
  want = np.concatenate([trainer[row, start + len(p) - 1:start + len(p) - 1 + len(c)]
                         for (row, start), p, c in zip(placements, PROMPTS, continuations)])
  got = np.concatenate(scored)
  check("teacher scoring equals the trainer's log-probs",
        got.shape == want.shape and np.abs(got - want).max() < LOGPROB_ATOL,
        f"max {np.abs(got - want).max():.2e}, {seconds:.2f} s")

  # A partial rollout: once the short request is back, the long ones are aborted by their
  # exact rids (SGLang drops a rid prefix) and return what they generated.
  started = time.perf_counter()
  cut = engine.generate([PROMPTS[0]] * 5, SamplingParams(4000), seed=0,
                        max_new_tokens=[4] + [4000] * 4,
                        stop_when=lambda index, completion: index == 0)
  seconds = time.perf_counter() - started
  lengths = [len(c.token_ids) for c in cut]
  check("partial rollout: the budget holds through aborts by rid",
        [c.finish_reason for c in cut] == ["length"] + ["abort"] * 4 and
        all(n < 4000 for n in lengths[1:]), f"lengths {lengths}, {seconds:.2f} s")
  prompt = tuple(PROMPTS[0]) + tuple(cut[1].token_ids.tolist())
  rest = client.generate([Request("resumed", prompt, 4000 - lengths[1])],
                         SamplingParams(4000))[0]
  check("a resumed partial rollout runs to its budget",
        rest.finish_reason == "length" and lengths[1] + len(rest.token_ids) == 4000)

  # Hybrid deployment (the server runs --enable-memory-saver): paused and released, the GPU
  # memory in use falls by most of the KV cache pool (--mem-fraction-static 0.2 of the GPU);
  # the next sync takes weights and cache back around its load, and the greedy tokens are
  # v1's again.
  total, before = _gpu_mib("memory.total"), _gpu_mib("memory.used")
  release_s = engine.release_memory()
  released = _gpu_mib("memory.used")
  resume_s = client.sync_weights(v1, 1)
  resumed = _gpu_mib("memory.used")
  again = client.generate([Request(f"hybrid-{i}", tuple(p), 32) for i, p in
                           enumerate(PROMPTS)], greedy)
  check("hybrid: a release frees the server's memory and a sync takes it back",
        before - released > 0.1 * total and abs(resumed - before) < 0.05 * total and
        [a.token_ids.tolist() for a in again] == [a.token_ids.tolist() for a in after],
        f"used {before} -> {released} -> {resumed} MiB of {total}, release {release_s:.2f} s, "
        f"resume + load {resume_s:.2f} s")

  # Behind the real sglang-router (rollouts/router.py, the flags the trainer uses): the same
  # greedy tokens as straight from the server; a weight sync still reaches the worker.
  from rollouts import router
  router_process, router_url = router.launch([url])
  try:
    routed = SGLangClient([url], router=router_url)
    via = routed.generate([Request(f"routed-{i}", tuple(p), 32) for i, p in
                           enumerate(PROMPTS)], greedy)
    check("through sglang-router: tokens equal the server's",
          [v.token_ids.tolist() for v in via] == [a.token_ids.tolist() for a in after])
    seconds = routed.sync_weights(v0, 2)
    check("through sglang-router: weight sync", routed.model_info()[url].get(
        "weight_version") == "2", f"{seconds:.2f} s")
    routed.close()
  finally:
    router.stop(router_process)
  print(json.dumps({"failures": failures}))
  sys.exit(1 if failures else 0)


def refit_check(fmt: str, url: str, weights_dir: str) -> None:
  """A server serving WEIGHTS_DIR/v000000 in `fmt` is refit from disk with v000001 (by
  SGLangClient.sync_weights, as SGLangEngine would, which refuses INT4 ahead of a run).
  FP8: it must answer success, report version 1, and greedy-decode as the embedded engine
  holding v1 as stored (log-probs within LOGPROB_ATOL). INT4: sglang 0.5.23's source says the
  refit takes the server down (rollouts/sglang_engine.py refusals): PASS when it does; a server
  that survives and serves v1 fails the check, so that the refusal can be lifted."""
  # As stored (quantize.Packed): requantizing dequantized INT4 would pick other scales.
  v0, v1 = (os.path.join(weights_dir, f"v{i:06d}") for i in (0, 1))
  cfg, params0 = hf.load(v0, dtype="bfloat16", param_dtype="bfloat16", packed=True)
  _, params1 = hf.load(v1, dtype="bfloat16", param_dtype="bfloat16", packed=True)
  client = SGLangClient([url], retries=1, control_timeout=120)
  client.check_health(300)
  greedy = SamplingParams(32, temperature=0.0)

  def served(tag: str):
    return client.generate([Request(f"{tag}-{i}", tuple(p), 32) for i, p in
                            enumerate(PROMPTS)], greedy)

  def close_to(made, params) -> tuple[bool, float]:
    local = JaxEngine(cfg, params).generate(PROMPTS, greedy, seed=0)
    gap = max(float(np.abs(m.logprobs[:8] - l.logprobs[:8]).max()) for m, l in zip(made, local))
    same = all(m.token_ids[:8].tolist() == l.token_ids[:8].tolist() for m, l in zip(made, local))
    return same and gap < LOGPROB_ATOL, gap

  ok, gap = close_to(served("before"), params0)
  print(f"{'PASS' if ok else 'FAIL'} {fmt}: served as the embedded {fmt} engine "
        f"(first 8 greedy tokens, log-prob gap {gap:.2e})", flush=True)
  failures = [] if ok else ["served"]
  started = time.perf_counter()
  try:
    client.sync_weights(v1, 1)
    error = None
  except Exception as e:  # noqa: BLE001 (reported)
    error = f"{type(e).__name__}: {e}"
  seconds = time.perf_counter() - started
  alive = True
  try:
    client.check_health(30)
  except Exception:  # noqa: BLE001 (down is an answer here)
    alive = False
  if fmt == "int4":
    ok = not alive
    print(f"{'PASS' if ok else 'FAIL'} int4 refit takes sglang down, as its source says "
          f"({error or 'the update answered success'}; {seconds:.2f} s)"
          + ("" if ok else ": it survived, so INT4 refits may work: check the outputs and "
             "lift rollouts/sglang_engine.py refusals"), flush=True)
  else:
    made = served("after") if alive and error is None else None
    close, gap = close_to(made, params1) if made else (False, float("nan"))
    version = client.model_info()[url].get("weight_version") if alive else None
    ok = alive and error is None and version == "1" and close and all(
        set(m.versions.tolist()) == {1} for m in made)
    print(f"{'PASS' if ok else 'FAIL'} fp8 refit from disk: version {version}, outputs those "
          f"of v1 as stored (gap {gap:.2e}), {seconds:.2f} s" + (f"; {error}" if error else ""),
          flush=True)
  failures += [] if ok else ["refit"]
  client.close()
  print(json.dumps({"format": fmt, "failures": failures}))
  sys.exit(1 if failures else 0)


def _random_adapters(params, cfg, lora_cfg: lora.LoraConfig, seed: int):
  """Adapters with B drawn too (a fresh adapter's B is zero: it would change nothing)."""
  adapters = lora.init_adapters(params, lora_cfg, cfg, jax.random.PRNGKey(seed))
  key = jax.random.PRNGKey(seed + 100)
  return jax.tree.map(lambda x: x.replace(b=0.05 * jax.random.normal(key, x.b.shape)),
                      adapters, is_leaf=lambda x: isinstance(x, lora.Adapter))


def lora_check(url: str, weights_dir: str) -> None:
  """A LoRA run's syncs on a real SGLang server started from WEIGHTS_DIR/v000000 with
  --enable-lora (SGLangEngine.update_adapters, as a run makes them): the first sends the base
  and then the adapter; each later one the adapter alone. Checks: greedy tokens and log-probs
  are the embedded engine's on the merged weights of the version each request names, and
  differ from the base's; each token is tagged with that version; the keep_versions newest
  adapters stay loaded (/v1/models); an adapter sync against a full sync, timed."""
  v0 = os.path.join(weights_dir, "v000000")
  cfg, base = hf.load(v0, dtype="bfloat16", param_dtype="bfloat16")
  client = SGLangClient([url], control_timeout=300)
  client.check_health(300)
  engine = SGLangEngine(client, cfg, weights_dir=os.path.join(weights_dir, "lora"),
                        weights_path=v0, export_dtype="bfloat16")
  lora_cfg = lora.LoraConfig(rank=8, alpha=16.0)
  greedy = SamplingParams(32, temperature=0.0)
  failures = []

  def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
      failures.append(name)

  plain = JaxEngine(cfg, base).generate(PROMPTS, greedy, seed=0)
  seconds = {}
  for version in (1, 2, 3):
    adapters = _random_adapters(base, cfg, lora_cfg, version)
    seconds[version] = engine.update_adapters(adapters, lora_cfg, version, base=lambda: base)
    made = engine.generate(PROMPTS, greedy, seed=0)
    local = JaxEngine(cfg, lora.merged(base, adapters)).generate(PROMPTS, greedy, seed=0)
    same = all(m.token_ids[:8].tolist() == l.token_ids[:8].tolist()
               for m, l in zip(made, local))
    gap = max(float(np.abs(m.logprobs[:8] - l.logprobs[:8]).max()) for m, l in zip(made, local))
    moved = any(m.token_ids.tolist() != p.token_ids.tolist() for m, p in zip(made, plain))
    check(f"adapter v{version}: served as the merged weights, not the base",
          same and gap < LOGPROB_ATOL and moved and
          all(set(m.versions.tolist()) == {version} for m in made),
          f"(first 8 greedy tokens, log-prob gap {gap:.2e}), sync {seconds[version]:.2f} s")
  cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
  loaded = sorted(c["id"] for c in cards if c["id"].startswith(engine.rid_prefix))
  want = [f"{engine.rid_prefix}-v2", f"{engine.rid_prefix}-v3"]
  check("the two newest adapters stay loaded", loaded == want, str(loaded))
  full = engine.update_weights(base, 4)
  print(f"adapter sync {min(seconds[2], seconds[3]):.2f} s (rank {lora_cfg.rank}) against a "
        f"full sync {full:.2f} s", flush=True)
  client.close()
  print(json.dumps({"lora": True, "failures": failures}))
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  if sys.argv[1] == "--refit":
    refit_check(*sys.argv[2:5])
  elif sys.argv[1] == "--lora":
    lora_check(*sys.argv[2:4])
  else:
    main(*sys.argv[1:4])
