"""Our server's LoRA adapters, served as SGLang 0.5.23 serves them with --enable-lora (read
from its source; `S/` is sglang/srt/): loaded from PEFT directories by name
(/load_lora_adapter), named by requests (/generate's lora_path: a name, a list per prompt,
null for the base), unloaded (/unload_lora_adapter) once no request uses them.

What a client can get wrong, as SGLang does it:
- every load gets a fresh id (S/lora/lora_registry.py L37), which the prefix cache keys by
  (S/managers/schedule_batch.py L1165-1170): a new version shares no cache with the old one;
- unload first unregisters the name, then waits, without a timeout, for the requests using it
  (S/managers/tokenizer_control_mixin.py L634-657), holding the lock that orders every load
  and unload;
- a request naming an adapter that was loaded once and is not now is not refused: the name is
  loaded again from its last path (S/managers/tokenizer_manager.py L3759-3790, "implicit
  reload"); only a name never loaded is refused;
- --max-loaded-loras evicts the least recently used unpinned adapter after a load (a request
  naming one makes it the most recent), waiting for its requests as unload does
  (tokenizer_control_mixin.py L708-736);
- the scale is lora_alpha / r for every module (S/lora/lora.py L71): rank_pattern,
  alpha_pattern and use_rslora are never read (models/hf_lora.py's `as_sglang`).
Messages and status codes are SGLang's, each cited where it is made.

Each adapter is served merged, W + (alpha / r) A B computed once at its load (and again when
the base's weights change), and a batch holds one adapter's requests or the base's alone
(Scheduler._next_batch). SGLang keeps adapters apart and adds each row's low-rank product
(its csgmv kernels), so that one batch mixes them; merged, an adapter decodes at the base's
speed, at the cost of a copy of the weights per loaded adapter.
"""

import collections
import dataclasses
import json
import os
import threading
import uuid
from typing import Any, Sequence

from models import hf_lora, lora
from models.config import ModelConfig
from rollouts.server.protocol import RequestError

# --lora-target-modules' choices that our models have (S/utils/common.py L4700-4722).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa",
                  "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj")
# SGLang compares normalised names: fused q/k/v, gate/up and MLA's a-projections
# (S/lora/utils.py L277-327).
_NORMALISED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
               "q_a_proj": "fused_qkv_a_proj_with_mqa",
               "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class AdapterError(ValueError):
  """A load or unload that failed: 400 with success false and this message."""


def normalised(targets: Sequence[str]) -> set[str]:
  return {_NORMALISED.get(t.split(".")[-1], t.split(".")[-1]) for t in targets}


@dataclasses.dataclass
class Served:
  """A loaded adapter: its name, path, fresh id and merged weights, and how many requests
  use it now."""
  name: str
  path: str
  pinned: bool
  lora_id: str
  adapters: Any  # models/lora.py's tree
  weights: Any  # the base with the adapters merged
  in_flight: int = 0


class Adapters:
  """The adapters a server holds. `max_rank`, `targets`: --max-lora-rank and
  --lora-target-modules (what a load must fit); `max_loaded`: --max-loaded-loras (None: no
  limit); `max_per_batch`: --max-loras-per-batch (SGLang's slots, the base's included: at
  most max_per_batch - 1 adapters pinned)."""

  def __init__(self, cfg: ModelConfig, *, max_rank: int, targets: Sequence[str],
               max_loaded: int | None = None, max_per_batch: int = 8):
    self.cfg, self.max_rank, self.targets = cfg, max_rank, tuple(targets)
    self.max_loaded, self.max_per_batch = max_loaded, max_per_batch
    self.registry: collections.OrderedDict[str, Served] = collections.OrderedDict()
    self.known: dict[str, tuple[str, bool]] = {}  # every name ever loaded: (path, pinned)
    self.startup: list[dict] = []  # --lora-paths, as /server_info reports them
    self.update_lock = threading.Lock()  # SGLang's lora_update_lock
    self.counts = threading.Condition()  # guards in_flight and the registry's order

  def loaded(self) -> dict[str, str]:
    """name -> path of every adapter held (the responses' loaded_adapters)."""
    with self.counts:
      return {name: s.path for name, s in self.registry.items()}

  def load(self, name: str, path: str, pinned: bool, base) -> None:
    """Load PEFT directory `path` as `name` over `base` (the served params); AdapterError
    with SGLang's message when it cannot be."""
    with self.update_lock:
      self._load_locked(name, path, pinned, base)

  def _load_locked(self, name: str, path: str, pinned: bool, base) -> None:
    if name in self.registry:  # S/lora/lora_manager.py L355-359
      raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
    if pinned and sum(s.pinned for s in self.registry.values()) >= self.max_per_batch - 1:
      raise AdapterError(  # lora_manager.py L378-383
          f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin "
          "all slots in the LoRA memory pool to avoid starvation for unpinned adapters and "
          "base models. Please increase your `--max-loras-per-batch` or load it as unpinned "
          "LoRA adapters.")
    adapters = self._read(name, path)
    served = Served(name, path, pinned, uuid.uuid4().hex, adapters, lora.merged(base, adapters))
    with self.counts:
      self.registry[name] = served
      self.known[name] = (path, pinned)
    while self.max_loaded is not None and len(self.registry) > self.max_loaded:
      victims = [n for n, s in self.registry.items() if not s.pinned]
      if not victims:  # tokenizer_control_mixin.py L716-720: the new one stays loaded
        raise AdapterError("Didn't find any LoRA adapters when trying to evict LRU LoRA "
                           f"adapter. LoRA registry is: {dict(self.registry)}")
      self._unload_locked(victims[0])

  def _read(self, name: str, path: str):
    """The adapters of PEFT directory `path`, checked as SGLang checks a load."""
    if not os.path.isdir(path):  # S/lora/lora_config.py L79-80 takes it for a hub id
      raise AdapterError("Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                         f"'{path}'. Use `repo_type` argument if needed.")
    config_path = os.path.join(path, hf_lora.CONFIG)
    if not os.path.isfile(config_path):  # lora_config.py L83-85
      raise AdapterError(f"[Errno 2] No such file or directory: '{config_path}'")
    with open(config_path) as f:
      config = json.load(f)
    for key in ("peft_type", "r", "lora_alpha", "target_modules"):
      if key not in config:  # str() of the KeyError (lora_config.py L42-44, lora.py L67)
        raise AdapterError(repr(key))
    if config.get("use_dora"):  # lora_manager.py L349-352
      raise AdapterError(f"Failed to load {name} because LoRA serving currently doesn't "
                         "support DoRA adapters")
    targets = config["target_modules"]
    fits = isinstance(targets, str) or "all" in self.targets or normalised(
        targets) <= normalised(self.targets)
    if config["r"] > self.max_rank or not fits:  # lora_manager.py L368-375
      raise AdapterError(
          f"LoRA adapter {name} with rank {config['r']} is incompatible with the current "
          "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
          "within the configured `--max-lora-rank` and that the target modules are included "
          "in `--lora-target-modules`.")
    if not any(f.endswith((".safetensors", ".bin", ".pt")) for f in os.listdir(path)):
      raise AdapterError(f"Cannot find any model weights with `{path}`")  # loader.py L579
    try:
      return hf_lora.load_adapter(path, self.cfg, as_sglang=True)[0]
    except (ValueError, OSError) as e:  # lora_manager.py L320-324: str(e)
      raise AdapterError(str(e)) from None

  def unload(self, name: str) -> None:
    """Unregister `name`, then wait for the requests using it (no timeout, as SGLang)."""
    with self.update_lock:
      if name not in self.registry:  # lora_registry.py L116-121
        raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                           f"odict_keys({list(self.registry)})")
      self._unload_locked(name)

  def _unload_locked(self, name: str) -> None:
    with self.counts:
      served = self.registry.pop(name)
      while served.in_flight:
        self.counts.wait()

  def acquire(self, names: Sequence[str | None], base) -> list[Served | None]:
    """The adapters `names` name (None: the base), each counted in flight until `release`;
    a name loaded once and not now is loaded again from its last path. RequestError with
    SGLang's message for a name never loaded (tokenizer_manager.py L3723-3797)."""
    unique = list(dict.fromkeys(n for n in names if n))
    if self.max_loaded is not None and len(unique) > self.max_loaded:
      raise RequestError(f"Received request with {len(unique)} unique loras requested but "
                         f"max loaded loras is {self.max_loaded}")
    for name in unique:
      if name in self.registry:
        continue
      if name not in self.known:
        raise RequestError(f"Got LoRA adapter that has never been loaded: {name}\n"
                           f"All loaded adapters: dict_keys({list(self.known)}).")
      try:
        self.load(name, *self.known[name], base)
      except AdapterError as e:
        if "already loaded" not in str(e):  # another request reloaded it first
          raise RequestError(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
    with self.counts:
      missing = [n for n in unique if n not in self.registry]
      if missing:  # unloaded meanwhile (lora_registry.py L136-141)
        raise RequestError(f"The following requested LoRA adapters are not loaded: "
                           f"{', '.join(missing)}\nLoaded adapters: "
                           f"odict_keys({list(self.registry)}).")
      served = [self.registry[n] if n else None for n in names]
      for s in served:
        if s is not None:
          s.in_flight += 1
          self.registry.move_to_end(s.name)  # the most recently used
    return served

  def release(self, served: Served) -> None:
    with self.counts:
      served.in_flight -= 1
      self.counts.notify_all()

  def rebase(self, base) -> None:
    """New base weights: every adapter merged over them."""
    with self.counts:
      for served in self.registry.values():
        served.weights = lora.merged(base, served.adapters)


def lora_names(body: dict, prompts: int, n: int) -> list[str | None]:
  """/generate's lora_path for each request `expand_request` makes (prompt-major, n each): a
  name for all, a list with one per prompt (null: the base), or none (io_struct.py
  L276-279, L635-643)."""
  given = body.get("lora_path")
  if given is None or given == "":
    return [None] * (prompts * n)
  if isinstance(given, str):
    return [given] * (prompts * n)
  if not isinstance(given, list) or not all(x is None or isinstance(x, str) for x in given):
    raise RequestError("lora_path must be a string, or a list of strings and nulls")
  if len(given) < prompts:  # SGLang fails on an IndexError (io_struct.py L1006): a 400 here
    raise RequestError(f"lora_path has {len(given)} entries for {prompts} prompts")
  return [name or None for name in given[:prompts] for _ in range(n)]
