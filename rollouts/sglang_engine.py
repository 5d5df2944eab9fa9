"""The RolloutEngine over SGLang servers, and the two factories that make one for a run:
`remote_engine` for SGLang servers someone started (a deployment), `local_engine` for our
server (rollouts/server/) started here as subprocesses on 127.0.0.1 (the production path,
minus the GPUs; CPU and TPU runs, the tests).

Owns what turns the client's calls (rollouts/sglang.py) into an engine: prompts as Requests
with rids of the run's own, images sent as SGLang takes them, weight exports to a directory
the servers read (Hugging Face checkpoints, bf16 or FP8; a few kept), the refit, the memory
release of a hybrid deployment, the servers this engine started, and what SGLang cannot serve
(`refusals`, raised as Unservable before any server is asked).
"""

import dataclasses
import itertools
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np

from models import hf, hf_lora
from rollouts import image_data
from rollouts import router as router_lib
from rollouts.engine import Capabilities, Completion, SamplingParams
from rollouts.server.main import launch
from rollouts.sglang import (DETERMINISTIC_ENV, Request, RequestImages, RoutesLayout,
                             SGLangClient, ServerError)

# Weight exports for the servers: shards this size, EXPORT_WORKERS written at once (a 1.5B
# model's 3 GiB of bf16 as 12 files, 4 at a time: bench/refit.py).
EXPORT_SHARD_BYTES = 256 * 2**20
EXPORT_WORKERS = 4
# local_engine's servers load adapters of ranks up to this (our server holds an adapter
# merged: no memory pool sized by it, as SGLang's is).
LORA_MAX_RANK = 512

# Requests are aborted by rid, weight syncs can let requests in flight finish, process 0
# drives the servers for every process, the weights travel as files, and the servers can
# release their memory between steps (started with --enable-memory-saver).
CAPABILITIES = Capabilities(abort=True, pause=True, serves_all_processes=True,
                            release_memory=True, adapters=True)


class Unservable(ValueError):
  """A configuration SGLang cannot serve, refused before any server is asked, naming the
  lines of SGLang that say why."""


def refusals(cfg, weight_format: str | None) -> str | None:
  """Why servers cannot be refit in `weight_format` (None when they can). INT4: SGLang 0.5.23
  serves a compressed-tensors pack-quantized checkpoint through CompressedTensorsWNA16, whose
  process_weights_after_loading repacks weight_packed and weight_scale for Marlin into plain
  parameters of other shapes without a weight_loader
  (layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py L234-245);
  nothing puts them back for a linear layer before the next load (base_config.py L49-54:
  only the MoE scheme restores, compressed_tensors_wNa16_moe.py L406-418), so the next
  /update_weights_from_disk fails at param.weight_loader (models/qwen2.py L704), the rollback
  reloads the same checkpoint outside any try (model_runner_components/weight_updater.py
  L193, L228-238) and the scheduler exits (managers/scheduler.py L6369-6374): the first
  refit takes the server down. Those who roll out in INT4 (slime and miles, Kimi K2 Thinking)
  quantize only the routed experts, and push them through patched or newer endpoints;
  longrl's INT4 export quantizes every projection."""
  if weight_format == "int4":
    return ("SGLang servers cannot be refit with INT4 (compressed-tensors) exports: SGLang "
            "0.5.23 repacks a linear layer's INT4 weights for Marlin without their "
            "weight_loader (compressed_tensors_wNa16.py L234-245, never restored: "
            "base_config.py L49-54), so the first /update_weights_from_disk fails at "
            "models/qwen2.py L704 and its rollback takes the server down "
            "(weight_updater.py L228-238, scheduler.py L6369-6374). Roll out INT4 on the "
            "embedded engine (embedded_engine.weight_format = 'int4'), or serve FP8 "
            "(weight_format = 'fp8')")
  return None


class SGLangEngine:
  """The RolloutEngine over SGLang servers. `update_weights` writes a Hugging Face
  checkpoint to `weights_dir/v<version>` (a directory the servers can read; config and,
  from `copy_from`, tokenizer files included) and syncs every server to it. For a mixture
  of experts every generate asks for the experts each token was routed to
  (Completion.routed_experts, for rollout routing replay); servers started with
  --enable-return-routed-experts return them, others none (and no error: moe.md 4.1)."""

  def __init__(self, client: SGLangClient, cfg, *, weights_dir: str,
               copy_from: str | None = None, version: int = 0, rid_prefix: str | None = None,
               keep_versions: int = 2, weights_path: str | None = None,
               processes: Sequence[subprocess.Popen] = (), export_dtype: str | None = None,
               weight_format: str | None = None, context_length: int | None = None):
    """`weights_path`: the checkpoint the servers already hold as `version` (None: none yet,
    update_weights exports one); `processes`: servers this engine started, stopped by
    close(); `export_dtype`: the dtype of the exported weights (None: the model's compute
    dtype, bfloat16 for a pretrained model: half the bytes of float32 master weights; start
    the servers with the same --dtype: SGLang's `auto` serves a float32 export in float16).
    `weight_format` ("fp8"; "int4" is refused, refusals): every export is a quantized
    checkpoint in that format (models/hf.py save), so the servers serve it quantized and a
    refit moves its bytes. The servers must start from a checkpoint in the same format:
    SGLang fixes the quantization method when it starts (configs/model_config.py L723-727,
    config.json's quantization_config) and a disk update loads new tensors into that model
    (model_runner_components/weight_updater.py L192-217). `rid_prefix` begins every rid
    (default: "longrl-" and 8 random hex digits, so that two trainers on one fleet never
    send the same rid: SGLang refuses a live one). `context_length`: the servers' (the most
    tokens a request may hold, SGLangClient.context_length), which the run's sequences must
    fit (Capabilities.context_length). A LoRA run's adapters go alone (update_adapters), to
    servers started with --enable-lora (ServerError at the first sync naming one that was
    not)."""
    refused = refusals(cfg, weight_format)
    if refused:
      raise Unservable(refused)
    self.client = client
    self.cfg = dataclasses.replace(cfg, param_dtype=export_dtype or cfg.dtype,
                                   weight_format=None)
    self.weight_format = weight_format
    self.weights_dir, self.copy_from = weights_dir, copy_from
    self.rid_prefix = rid_prefix or f"longrl-{uuid.uuid4().hex[:8]}"
    self.keep_versions, self.context_length = keep_versions, context_length
    self._version = version
    self._calls = itertools.count(1)  # numbers each call: its rids share a unique prefix
    self.weights_path = weights_path  # the checkpoint of the current version
    self.sync_seconds: list[float] = []
    self.processes = list(processes)
    self._memory_saver_checked = False
    self.adapter: tuple[str, int] | None = None  # the adapter requests run on: (name, version)
    self._adapters: list[tuple[str, str]] = []  # (name, directory) loaded, oldest first

  @property
  def version(self) -> int:
    return self._version

  @property
  def capabilities(self) -> Capabilities:
    return dataclasses.replace(CAPABILITIES, context_length=self.context_length)

  def _call_prefix(self, kind: str) -> str:
    """The rid prefix of a new call's requests: no other call's rids start with it."""
    return f"{self.rid_prefix}-{kind}{next(self._calls)}-"

  def requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
               seed: int, *, affinity: Sequence[int] | None = None,
               images: Sequence[Sequence[Any]] | None = None) -> list[Request]:
    """Requests with rids a new call's prefix + index, `max_new_tokens` each (or one per
    prompt); each goes to the server its affinity key picks (default: its prompt's hash, so
    the samples of a group share a server and its prefix cache). `images`: each prompt's
    (`_images`)."""
    if isinstance(max_new_tokens, int):
      max_new_tokens = [max_new_tokens] * len(prompts)
    for name, values in (("affinity keys", affinity), ("max_new_tokens", max_new_tokens),
                         ("image lists", images)):
      if values is not None and len(values) != len(prompts):
        raise ValueError(f"SGLangEngine: {len(values)} {name} for {len(prompts)} prompts")
    prefix = self._call_prefix("g")
    keys = affinity if affinity is not None else [hash(tuple(p)) & 0x7FFFFFFF for p in prompts]
    sent = self._images(prompts, images) if images is not None else [None] * len(prompts)
    return [Request(rid=f"{prefix}{i}", max_new_tokens=int(n), affinity=int(key),
                    sampling_seed=(seed * 1_000_003 + i) % 2**31, adapter=self.adapter,
                    input_ids=tuple(p) if ims is None else
                    tuple(image_data.collapse(p, ims.image_token_id)), images=ims)
            for i, (p, n, key, ims) in enumerate(zip(prompts, max_new_tokens, keys, sent))]

  def _images(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Any]]
              ) -> list[RequestImages | None]:
    """Each prompt's RequestImages (None without images): its images as data URLs of PNG
    bytes (image_data.data_url; encoded once per image object of the call: a group's samples
    share their record's). A prompt holds each image as its run of image tokens, in order
    (as the trainer's: models.vision.expand_image_tokens), SGLang one token each
    (docs/sglang.md 3(j)); a continuation (prompt + tokens so far) too, unless a generated
    image token makes a run more (ValueError: SGLang would take it for a placeholder)."""
    if self.cfg.vision is None:
      raise ValueError(f"SGLangEngine.generate: images given to a {self.cfg.family} model, "
                       "which has no vision tower")
    token = self.cfg.vision.image_token_id
    urls: dict[int, str] = {}
    out = []
    for i, (prompt, ims) in enumerate(zip(prompts, images)):
      runs = len(image_data.run_lengths(prompt, token))
      if not ims and not runs:
        out.append(None)
        continue
      if runs != len(ims):
        raise ValueError(f"SGLangEngine.generate: prompt {i} holds {runs} runs of image "
                         f"tokens (id {token}) for its {len(ims)} images")
      for im in ims:
        if id(im) not in urls:
          urls[id(im)] = image_data.data_url(im)
      out.append(RequestImages(tuple(urls[id(im)] for im in ims), tuple(prompt), token))
    return out

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
               seed: int, affinity: Sequence[int] | None = None,
               max_new_tokens: Sequence[int] | None = None,
               on_ready: Callable[[dict[int, Completion]], None] | None = None,
               stop_when: Callable[[int, Completion], bool] | None = None,
               images: Sequence[Sequence[Any]] | None = None) -> list[Completion]:
    """Once `stop_when` says stop, this call's requests still running are aborted (by their
    rids) and the ones not yet sent are not sent. `seed` seeds the requests' sampling_seed,
    which SGLang honours only with --enable-deterministic-inference. `images` (a
    vision-language model's): each prompt's raw images (as JaxEngine's), sent as image_data
    with the prompt's image tokens collapsed (_images); ServerError if a server expands them
    to other counts than the prompt's (check_expansion)."""
    if not prompts:
      return []
    limits = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    return self.client.generate(self.requests(prompts, limits, seed, affinity=affinity,
                                              images=images),
                                sampling, on_ready=on_ready, stop_when=stop_when,
                                routes=RoutesLayout.of(self.cfg))

  def score(self, prompts: Sequence[Sequence[int]],
            continuations: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Teacher scoring on the servers: f32[len(continuation)] log-probs per pair; the
    servers' weight version must be this engine's."""
    return [logprobs for logprobs, *_ in self._score(prompts, continuations, 0)]

  def score_top_k(self, prompts: Sequence[Sequence[int]],
                  continuations: Sequence[Sequence[int]], k: int
                  ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Teacher scoring with top-k distillation's teacher side (SGLang's top_logprobs_num on
    the input tokens), as JaxEngine.score_top_k: per pair f32[n], i32[n, k], f32[n, k]."""
    if k < 1:
      raise ValueError(f"SGLangEngine.score_top_k: k must be >= 1, got {k}")
    return [(logprobs, ids, top) for logprobs, _, ids, top in
            self._score(prompts, continuations, k)]

  def _score(self, prompts, continuations, top_k: int) -> list[tuple]:
    prefix = self._call_prefix("score")
    # Each pair goes to its prompt's server (the one that generated it: its prefix cache).
    requests = [Request(rid=f"{prefix}{i}",
                        input_ids=tuple(p) + tuple(c), max_new_tokens=0,
                        affinity=hash(tuple(p)) & 0x7FFFFFFF)
                for i, (p, c) in enumerate(zip(prompts, continuations))]
    scored = self.client.score(requests, [len(p) for p in prompts], top_k=top_k)
    stale = {v for _, v, *_ in scored if v != self._version}
    if stale:
      raise ServerError(f"teacher scoring: servers answered at weight version(s) "
                        f"{sorted(stale)}, not {self._version}")
    return scored

  def add_worker(self, url: str) -> None:
    """A new server (already up at `url`) joins at this engine's current weights."""
    if self.weights_path is None:
      raise ServerError(f"add_worker {url}: no weights exported yet to load it with")
    self.client.add_worker(url, self.weights_path, self._version)

  def export(self, params, version: int) -> str:
    name = f"v{version:06d}"
    path = os.path.join(self.weights_dir, name)
    hf.save(params, self.cfg, path, copy_from=self.copy_from,
            max_shard_bytes=EXPORT_SHARD_BYTES, workers=EXPORT_WORKERS,
            quantization=self.weight_format)
    # Kept: this version and the keep_versions - 1 below it (a server may still be loading
    # one). Versions above it come from a run that died after them (this one resumed from an
    # earlier checkpoint, or another run used the directory): nothing will read them.
    older = sorted(d for d in os.listdir(self.weights_dir) if d.startswith("v") and d < name)
    newer = [d for d in os.listdir(self.weights_dir) if d.startswith("v") and d > name]
    for stale in older[:max(0, len(older) - (self.keep_versions - 1))] + newer:
      shutil.rmtree(os.path.join(self.weights_dir, stale), ignore_errors=True)
    return path

  def release_memory(self) -> float:
    """Every server releases its weights and KV cache (SGLangClient.release_memory) until
    the next update_weights; ServerError first if one was not started with
    --enable-memory-saver (it would free nothing). Returns the seconds."""
    if not self._memory_saver_checked:  # without it SGLang's adapter is a no-op
      # (utils/torch_memory_saver_adapter.py L139-160)
      self.client.check_started_with("--enable-memory-saver",
                                     "releasing memory between steps (RLConfig.hybrid)")
      self._memory_saver_checked = True
    return self.client.release_memory()

  def close(self) -> None:
    self.client.close()
    for process in self.processes:
      process.terminate()
    for process in self.processes:
      try:
        process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        process.kill()
    self.processes = []

  def update_adapters(self, adapters, lora, version: int, *, base: Callable[[], Any],
                      while_generating: bool = False, arm: int | None = None) -> float:
    """A LoRA run's sync: `adapters` (models/lora.py's tree, of LoraConfig `lora`) written as
    a PEFT directory weights_dir/a<version> and loaded by every server under a name of this
    version's own, `rid_prefix`-v<version> (SGLang reloads a name it held before from that
    name's last path, so that a name unloaded and loaded again races with the requests
    naming it: docs/sglang.md 3(n)); every request from now on names it, and its tokens are
    tagged with `version`. `arm`: the adapters are arm `arm`'s (rl/arms.py), their directory
    and name that arm's own (a<version>-arm<arm>, `rid_prefix`-arm<arm>-v<version>), so that
    arms synced at one version do not meet. The frozen base (`base()`) goes to the servers as
    full weights first, once (and again after they released their memory: RLConfig.hybrid).
    Requests in flight are aborted, or, `while_generating`, finish on the adapter they
    started with. The keep_versions newest adapters stay loaded; an older one is unloaded
    (each server returns once no request uses it) and its directory removed. Returns the
    seconds."""
    started = time.perf_counter()
    if self.adapter is None:  # the servers hold the start's weights, not yet the base
      self.client.check_started_with("--enable-lora", "a LoRA run's adapter syncs "
                                     "(RLConfig.lora)")
    if self.adapter is None or self.client.released:  # or released it (a hybrid step)
      self.update_weights(base(), version, while_generating=while_generating)
      self.sync_seconds.pop()  # counted in this sync's
    own = "" if arm is None else f"-arm{arm}"
    name = f"{self.rid_prefix}{own}-v{version}"
    directory = f"a{version:06d}{own}"
    path = hf_lora.save_adapter(adapters, self.cfg, lora,
                                os.path.join(self.weights_dir, directory))
    if not while_generating:
      self.client.abort_all()
    self.client.load_adapter(name, path)
    self.adapter, self._version = (name, version), version
    self._adapters.append((name, directory))
    while len(self._adapters) > self.keep_versions:
      self.client.unload_adapter(self._adapters.pop(0)[0])
    kept = {kept_directory for _, kept_directory in self._adapters}
    for stale in os.listdir(self.weights_dir):
      if stale.startswith("a") and stale not in kept:
        shutil.rmtree(os.path.join(self.weights_dir, stale), ignore_errors=True)
    seconds = time.perf_counter() - started
    self.sync_seconds.append(seconds)
    return seconds

  def update_weights(self, params, version: int, *, while_generating: bool = False) -> float:
    """Export, sync every server, and return the seconds the whole update took. Requests in
    flight are aborted, or, `while_generating`, finish on the old weights first."""
    started = time.perf_counter()
    path = self.export(params, version)
    self.client.sync_weights(path, version,
                             in_flight="finish" if while_generating else "abort")
    self._version, self.weights_path = version, path
    seconds = time.perf_counter() - started
    self.sync_seconds.append(seconds)
    return seconds


def remote_engine(cfg, params, version: int, *, urls: Sequence[str] = (),
                  router: str | None = None, weights_dir: str = "", copy_from: str | None = None,
                  max_in_flight: int = 64, read_timeout: float = 3600.0,
                  health_timeout: float = 300.0, export_dtype: str | None = None,
                  weight_format: str | None = None) -> SGLangEngine:
  """train.rollout_engine for running SGLang servers: waits for every server's /health (a
  starting one answers 503 or refuses connections; ServerError naming each one that does
  not answer 200 within `health_timeout` s), reads their context length (which the run's
  sequences must fit: rl/sources.py refuses seq_len + 1 above it), then loads the starting
  weights into every server (written under `weights_dir`, which the servers must be able to
  read at the same path; `copy_from` supplies the tokenizer files; `export_dtype` e.g.
  'bfloat16', and `weight_format` 'fp8' (servers started on a checkpoint in that format), see
  SGLangEngine; 'int4' is refused before any server is asked: `refusals`). The servers'
  --api-key and --admin-api-key, if they have them, come from the environment
  (LONGRL_SGLANG_API_KEY, LONGRL_SGLANG_ADMIN_API_KEY: SGLangClient), so that no key is
  written into a run's config.gin. A LoRA run syncs its adapters alone
  (SGLangEngine.update_adapters): start the servers with --enable-lora, a --max-lora-rank
  at least its rank and --lora-target-modules covering its targets."""
  if not urls or not weights_dir:
    raise ValueError("remote_engine needs urls (the SGLang workers) and weights_dir (a "
                     "directory they share with the trainer)")
  refused = refusals(cfg, weight_format)
  if refused:
    raise Unservable(refused)
  client = SGLangClient(urls, router=router, max_in_flight=max_in_flight,
                        read_timeout=read_timeout,
                        api_key=os.environ.get("LONGRL_SGLANG_API_KEY"),
                        admin_api_key=os.environ.get("LONGRL_SGLANG_ADMIN_API_KEY"))
  try:
    client.check_health(health_timeout)
    if os.environ.get(DETERMINISTIC_ENV) == "1":
      # Without it SGLang ignores sampling_seed (sampling/sampling_batch_info.py L157-172)
      # and a batch's makeup changes a request's numbers.
      client.check_started_with("--enable-deterministic-inference", "a reproducible run")
    engine = SGLangEngine(client, cfg, weights_dir=weights_dir, copy_from=copy_from,
                          version=version, export_dtype=export_dtype,
                          weight_format=weight_format, context_length=client.context_length())
    engine.update_weights(params, version)
  except BaseException:
    client.close()
    raise
  return engine


remote_engine.capabilities = CAPABILITIES  # known before it makes one (rl.sources.check)


def local_engine(cfg, params, version: int, *, servers: int = 1, weights_dir: str = "",
                 max_batch: int = 64, router: bool = False,
                 cores: Sequence[int] = (), checkpoint: str = "",
                 export_dtype: str | None = None, memory_saver: bool = False,
                 weight_format: str | None = None):
  """The engine factory (train.engine) that serves the policy from `servers` subprocesses of
  our server (rollouts/server/) on 127.0.0.1 and talks to them with the SGLang client
  (rollouts/sglang.py): the production path, minus the GPUs. Weights travel through
  `weights_dir` (default: a temporary directory) as Hugging Face checkpoints. `max_batch`:
  the most requests a server decodes at once, and so the most the client keeps in flight on
  each (more would only queue there). `router`: /generate goes through the real
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
  as it is for SGLang (refusals). A mixture of experts' servers start
  with --enable-return-routed-experts (rollout routing replay). They start ready for a LoRA
  run's adapters (--enable-lora, ranks up to LORA_MAX_RANK, every projection), which it
  syncs alone (SGLangEngine.update_adapters)."""
  refused = refusals(cfg, weight_format)
  if refused:
    raise Unservable(refused)
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
                             *(["--enable-return-routed-experts"] if cfg.moe else []),
                             "--enable-lora", "--max-lora-rank", str(LORA_MAX_RANK),
                             "--lora-target-modules", "all"],
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
  engine = SGLangEngine(
      SGLangClient(urls, router=router_url, max_in_flight=max_batch), cfg,
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


local_engine.capabilities = CAPABILITIES  # known before it makes one
