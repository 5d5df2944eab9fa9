"""The RolloutEngine protocol: what every generator of completions promises the trainer, the
Capabilities an engine declares beyond it, and the Scorer protocol of engines that score
given tokens (teachers).

Owns the request and result types. It does not own sampling (each engine does) or
anything about training. Code above rollouts/ reads an engine's `capabilities`, never its
class.
"""

import dataclasses
from typing import Callable, Literal, Protocol, Sequence

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy; top_p 1 means no nucleus cut."""

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class Completion:
  """One generated continuation.

  token_ids: i32[n] generated tokens, the stop token included when finish_reason == "stop".
  logprobs: f32[n] log-prob of each token under the engine's policy at temperature 1
    (before temperature and top-p), which is what the trainer recomputes.
  versions: i32[n] the weight version that produced each token.
  policy_mask: bool[n] True on the tokens the policy generated, False on tokens an
    environment inserted (a multi-turn episode's observations: log-prob 0, out of the loss);
    None when every token is the policy's.
  routed_experts: for a mixture of experts, i32[len(prompt) + n - 1, sparse layers, k]: the
    experts each input token went to in the engine, the prompt's then the generated ones'
    but the last (which predicts nothing kept): SGLang's routed_experts layout. None for a
    dense model, or an engine that does not record them.
  """

  token_ids: np.ndarray
  logprobs: np.ndarray
  finish_reason: FinishReason
  versions: np.ndarray
  policy_mask: np.ndarray | None = None
  routed_experts: np.ndarray | None = None

  def cut(self, limit: int) -> "Completion":
    """At most `limit` tokens (a longer one ends "length" there), its routes cut with them."""
    extra = len(self.token_ids) - limit
    if extra <= 0:
      return self
    routes = self.routed_experts
    return dataclasses.replace(
        self, token_ids=self.token_ids[:limit], logprobs=self.logprobs[:limit],
        finish_reason="length", versions=self.versions[:limit],
        policy_mask=None if self.policy_mask is None else self.policy_mask[:limit],
        routed_experts=None if routes is None else routes[:len(routes) - extra])


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What an engine can do beyond generating and taking weights.

  abort: generate honours `stop_when`: once it says stop, the requests still running come
    back cut short (finish_reason "abort") with the tokens they have, and those not yet
    started come back empty (partial rollouts pause this way).
  pause: update_weights(while_generating=True) is safe while a generate runs on another
    thread; its requests finish on the weights they started with (rollouts ahead of the
    trainer).
  serves_all_processes: one engine, made on JAX process 0, generates for every process (a
    fleet of servers); without it each process has an engine of its own (in memory) and
    generates its share.
  keeps_weight_arrays: the engine holds the very arrays update_weights is given (in
    memory), so a caller that updates them in place afterwards (a donating train step)
    must hand it a copy; servers export the weights and keep nothing.
  release_memory: the engine has `release_memory() -> seconds`, which frees its weights and
    KV cache between generations (a hybrid deployment: the trainer has the memory while it
    trains); the next update_weights takes them back with the new weights, and generating
    or scoring before it is an error.
  context_length: the most tokens (prompt + completion) one request may hold (a server's
    --context-length: SGLang refuses a request above it); None: no limit.
  adapters: the engine has `update_adapters(adapters, lora, version, *, base,
    while_generating=False, arm=None) -> seconds`, which takes a LoRA run's adapters alone
    (of models.lora.LoraConfig `lora`: servers load each version as a PEFT directory under a
    name of its own, an arm's (rl/arms.py) under its arm's, and every request names the
    adapter it runs on), and its frozen base once (`base()` gives it). Without it a LoRA
    run's engine gets merged weights through update_weights.
  """
  abort: bool = False
  pause: bool = False
  serves_all_processes: bool = False
  keeps_weight_arrays: bool = False
  release_memory: bool = False
  context_length: int | None = None
  adapters: bool = False


class RolloutEngine(Protocol):
  """Generates completions for token prompts and takes new weights with a version number."""

  @property
  def version(self) -> int: ...

  @property
  def capabilities(self) -> Capabilities: ...

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
               seed: int, affinity: Sequence[int] | None = None,
               max_new_tokens: Sequence[int] | None = None,
               on_ready: Callable[[dict[int, Completion]], None] | None = None,
               stop_when: Callable[[int, Completion], bool] | None = None,
               images: Sequence[Sequence[object]] | None = None) -> list[Completion]:
    """One completion per prompt. `affinity` (one key per prompt) picks the server where an
    engine has several: the same key, the same server, so that the continuations of one
    multi-turn episode find their prefix in its cache. Engines with one model ignore it.
    `max_new_tokens` (one per prompt, each at most sampling.max_new_tokens) replaces
    sampling.max_new_tokens prompt by prompt (a resumed trajectory has fewer left).
    `on_ready({prompt index: completion})` is called, before generate returns, with each
    completion once as soon as it is done (so that it can be verified while the rest are
    generated): one by one on servers, all in one call by an engine that makes them together.
    It may run on another thread and must return quickly.
    `stop_when(index, completion)`, for engines with Capabilities.abort only, is asked as
    each completion arrives (on the engine's thread, quickly); once it says True the
    requests still running are aborted and come back cut short ("abort").
    `images` (a vision-language model's; JaxEngine and SGLangEngine take them): each
    prompt's images, raw (PNG/JPEG bytes, a path, a PIL image), in the order of its runs of
    image tokens; the engine, or its server, preprocesses them as the trainer does
    (models.vision.preprocess)."""
    ...

  def update_weights(self, params, version: int, *, while_generating: bool = False) -> float:
    """Take new weights; returns the seconds the update took (export and sync included).
    `while_generating`: a generate may be running on another thread (rollouts ahead of the
    trainer); its requests finish on the weights they started with, tagged with their
    version."""
    ...

  def close(self) -> None:
    """Release what the engine started (server processes, connections)."""
    ...


class Scorer(Protocol):
  """Scores given tokens without generating: a prefill that returns their log-probs (a
  teacher in on-policy distillation). JaxEngine and SGLangEngine are both."""

  @property
  def version(self) -> int: ...

  def score(self, prompts: Sequence[Sequence[int]],
            continuations: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """f32[len(continuation)] per pair: log p(token | prompt, the continuation before it) at
    temperature 1."""
    ...
