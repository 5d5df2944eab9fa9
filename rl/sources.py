"""Rollout sources: where each RL step's trajectories come from, composable like optax pieces.

A source makes one step's rollouts: whole groups (the samples of one prompt), verified, at
most RLConfig.prompts_per_step of them. It reads and advances the rollout side of the loop
state (`RolloutState`: the RNG prompts are drawn with, the prompt statistics and sampler
state, and the source's own state, e.g. a replay buffer) and nothing else; rewards, the KL
in the reward and advantages come after any source, once, in the loop (rl/loop.py).

    Lockstep()                      draw prompts, generate their groups on the current weights
    DynamicSampling(inner)          keep only groups with mixed verdicts (DAPO), draw again
                                    until the step has enough
    Partial(token_budget | finish_fraction)
                                    pause generation by a token budget (k1.5) or once a
                                    fraction of trajectories finished (K3's lambda); unfinished
                                    groups wait in a replay buffer and resume on newer weights
    Ahead(inner, max_staleness)     make the next steps' rollouts on a thread while a step
                                    trains, at most max_staleness versions behind
    AgentRollouts(agent)            (rl/agents/rollouts.py) the episodes of an agent's own
                                    program, its calls through the agent endpoint

A source is a small class (a `Source`) with `next(context, state, step, gate) -> (Made,
state)` and, where it needs them, `init(context) -> state` (a pytree, saved with the loop
state), `refusals(context) -> [reasons]` (the combinations it cannot run in), `concurrent`
(it generates while the trainer updates), `synced(version)` and `close()`. `check` applies
every source's refusals: the one place where a combination is refused.

Owns drawing prompts (`draw`), the process share of a step's generation, recording prompt
statistics, and the sources. It does not own generation or verification (rl/rollout.py,
rl/envs/driver.py) or training.
"""

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import distributed
from models.tokenizer import stop_ids
from rl import ConfigError
from rl import rollout
from rl import sampling as sampling_lib
from rl import tasks as tasks_lib
from rl.config import RLConfig
from rl.envs import driver
from rl.envs.base import environment_of, multi_turn
from rl.replay import ReplayBuffer, complete_groups
from rl.trajectory import Trajectory
from rollouts.engine import Capabilities, RolloutEngine, SamplingParams


@flax.struct.dataclass
class RolloutState:
  """The rollout side of the loop state: what a source reads and advances."""
  rng: jax.Array  # u32[2] prompts and sampling seeds are drawn with
  prompt_stats: sampling_lib.PromptStats
  sampler_state: Any
  source: Any  # the source's own state (rl.sources.Partial: its replay buffer)


@dataclasses.dataclass(frozen=True)
class Context:
  """What sources generate with. `engine` is None on the processes other than 0 when one
  engine serves them all (Capabilities.serves_all_processes), and before it is made;
  `capabilities` are its capabilities when known without it (an engine factory's)."""
  engine: RolloutEngine | None
  task: Any
  tokenizer: Any
  config: RLConfig
  sampler: sampling_lib.SamplingTransform
  capabilities: Capabilities | None = None

  @property
  def can(self) -> Capabilities | None:
    """What the engine can do (None: not known yet)."""
    return self.engine.capabilities if self.engine is not None else self.capabilities

  @property
  def vision(self):
    """A vision-language model's VisionConfig (its tokenizer's: models.tokenizer.WithImages),
    by which trajectories with images are batched; None for a text model."""
    return getattr(self.tokenizer, "vision", None)

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(max_new_tokens=self.config.max_new_tokens,
                          temperature=self.config.temperature, top_p=self.config.top_p,
                          stop_token_ids=stop_ids(self.tokenizer))


@dataclasses.dataclass
class Made:
  """One step's rollouts: whole groups, group by group (each group's samples together), at
  most prompts_per_step groups; metrics: generate_s, verify_s, verify_busy_s, and the
  source's own (generation_rounds, partial_*, ...)."""
  trajectories: list[Trajectory]
  metrics: dict[str, float]


def init_state(context: Context, source: "Source", seed: int) -> RolloutState:
  """The rollout state before the first RL step."""
  num_prompts = len(context.task.train)
  return RolloutState(jax.random.PRNGKey(seed), sampling_lib.PromptStats.create(num_prompts),
                      context.sampler.init(num_prompts), source.init(context))


def draw(context: Context, state: RolloutState, step: int
         ) -> tuple[np.ndarray, int, RolloutState]:
  """prompts_per_step prompt indices from the sampler's weights, and a generation seed
  (different on every JAX process)."""
  rng, draw_key, gen_key = jax.random.split(state.rng, 3)
  weights, sampler_state = context.sampler.update(state.prompt_stats, state.sampler_state,
                                                  step=step)
  indices = np.asarray(sampling_lib.draw(draw_key, weights, context.config.prompts_per_step))
  seed = int(jax.random.randint(gen_key, (), 0, 2**31 - 1)) + jax.process_index()
  return indices, seed, state.replace(rng=rng, sampler_state=sampler_state)


def record_stats(state: RolloutState, trajectories: list[Trajectory], group_size: int,
                 step: int) -> RolloutState:
  """The prompt statistics with every group of `trajectories` (group by group) counted."""
  groups = len(trajectories) // group_size
  correct = np.array([t.correct for t in trajectories], bool)
  successes = correct.reshape(groups, group_size).sum(axis=1)
  records = [trajectories[g * group_size].record_index for g in range(groups)]
  return state.replace(prompt_stats=state.prompt_stats.record(
      jnp.asarray(np.asarray(records)), group_size, jnp.asarray(successes), step=step))


def no_gate() -> None:
  pass


class Source:
  """A rollout source's defaults (stateless, refuses nothing, generates only when asked);
  a source subclasses it and writes `next`:

    next(context, state, step, gate=no_gate) -> (Made, state): step `step`'s rollouts from
      the rollout state, and that state advanced past them; `gate()` is called before the
      first collective (with several processes, a source ahead of the trainer waits there
      for its turn).
    init(context) -> its own state (a pytree saved with the loop state; () for none).
    refusals(context) -> why it cannot run in `context` (empty when it can).
    concurrent: it generates while the trainer updates (the engine then gets copies of the
      weights, taken while it generates).
    synced(version): the engine now holds weights of `version`. close(): stop what it runs.
  """
  concurrent = False

  def init(self, context: Context) -> Any:
    del context
    return ()

  def refusals(self, context: Context) -> list[str]:
    del context
    return []

  def synced(self, version: int) -> None:
    del version

  def close(self) -> None:
    pass


@dataclasses.dataclass
class Lockstep(Source):
  """Each step draws prompts_per_step prompts and generates samples_per_prompt trajectories of
  each on the weights the engine holds (the current ones, unless RLConfig.weight_sync_every
  says otherwise). With an engine on every JAX process each generates its share of the
  groups; with servers, process 0 generates them all. Every process gets all of them."""

  def next(self, context: Context, state: RolloutState, step: int,
           gate: Callable[[], None] = no_gate) -> tuple[Made, RolloutState]:
    indices, seed, state = draw(context, state, step)
    size = context.config.samples_per_prompt
    engine = context.engine
    if engine is not None and not engine.capabilities.serves_all_processes:
      mine = indices[tasks_lib.share_slice(len(indices))]
      records = tasks_lib.process_share(context.task.train, indices)
    else:
      mine = indices if distributed.is_primary() else indices[:0]
      records = [context.task.train[int(i)] for i in mine]
    metrics = {"generate_s": 0.0, "verify_s": 0.0, "verify_busy_s": 0.0}
    part = distributed.checked(lambda: rollout.generate(
        engine, context.task, context.tokenizer, records, context.sampling, samples=size,
        seed=seed, max_sequence_tokens=context.config.seq_len + 1,  # a row's room
        record_indices=mine, timings=metrics) if records else None, before_exchange=gate)
    trajectories = [t for p in distributed.gather(part) if p is not None for t in p]
    for i, t in enumerate(trajectories):  # groups numbered across processes
      t.group = i // size
    metrics["generation_rounds"] = 1
    return Made(trajectories, metrics), record_stats(state, trajectories, size, step)


def _mixed(group: list[Trajectory]) -> bool:
  return len({t.correct for t in group}) > 1


def _groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
  groups: dict[int, list[Trajectory]] = {}
  for t in trajectories:
    groups.setdefault(t.group, []).append(t)
  return list(groups.values())


# Metrics that describe the source's state after a call, not a count over calls.
_LEVELS = ("replay_size", "stale_token_fraction")


@dataclasses.dataclass
class DynamicSampling(Source):
  """DAPO's dynamic sampling (arXiv 2503.14476): drop the groups whose samples are all correct
  or all wrong (they have no advantage) and ask `inner` for more until the step has
  prompts_per_step groups, at most `max_rounds` times (then an error, as in verl's recipe).
  Every group generated counts in the prompt statistics, kept or not."""
  inner: Any = dataclasses.field(default_factory=Lockstep)
  max_rounds: int = 8

  def init(self, context: Context) -> Any:
    return self.inner.init(context)

  def refusals(self, context: Context) -> list[str]:
    own = [] if self.max_rounds >= 1 else [
        f"DynamicSampling.max_rounds={self.max_rounds} must be >= 1"]
    return own + self.inner.refusals(context)

  def next(self, context: Context, state: RolloutState, step: int,
           gate: Callable[[], None] = no_gate) -> tuple[Made, RolloutState]:
    wanted = context.config.prompts_per_step
    kept: list[list[Trajectory]] = []
    metrics: dict[str, float] = {}
    for _ in range(self.max_rounds):
      made, state = self.inner.next(context, state, step, gate)
      for key, value in made.metrics.items():
        metrics[key] = value if key in _LEVELS else metrics.get(key, 0) + value
      kept += [g for g in _groups(made.trajectories) if _mixed(g)]
      if len(kept) >= wanted:
        break
    else:
      raise RuntimeError(
          f"dynamic sampling: fewer than {wanted} groups with mixed verdicts after "
          f"{self.max_rounds} generation rounds at step {step}; raise "
          "DynamicSampling.max_rounds or make the prompts less uniform")
    for number, group in enumerate(kept[:wanted]):  # rounds number their groups alike
      for t in group:
        t.group = number
    return Made([t for g in kept[:wanted] for t in g], metrics), state


@dataclasses.dataclass
class Partial(Source):
  """Partial rollouts: long trajectories do not hold up a step. Each step's new groups (one per
  drawn prompt) join the unfinished ones from earlier steps, and an iteration advances them all
  (rl.envs.driver.advance with a Pause) until the tokens received reach `token_budget` (Kimi
  k1.5, arXiv 2501.12599 sec. 2.6.2) or ceil(finish_fraction * n) of its n trajectories have
  finished (Kimi K3's lambda); give exactly one. Iterations repeat (at most
  `max_iterations`) until a group is complete; up to prompts_per_step complete groups are
  trained, oldest first, and the rest wait in a replay buffer of `replay_capacity`
  trajectories (0: four steps' worth), saved with the loop state. Single-turn trajectories
  pause by aborting requests (an engine with Capabilities.abort: servers); multi-turn
  episodes also pause between waves on any engine. Every token keeps the version that
  generated it (rl/corrections.py weighs or masks the older ones)."""
  token_budget: int = 0
  finish_fraction: float = 0.0
  replay_capacity: int = 0
  max_iterations: int = 8

  def pause(self) -> driver.Pause:
    return driver.Pause(self.token_budget, self.finish_fraction)

  def refusals(self, context: Context) -> list[str]:
    out = []
    try:
      self.pause()
    except ValueError as e:
      out.append(f"Partial: {e}")
    if context.can is not None and not context.can.abort and not multi_turn(
        environment_of(context.task)):
      out.append("Partial (single-turn trajectories) needs an engine that can abort requests "
                 "(Capabilities.abort: e.g. train.engine = @local_engine or @remote_engine)")
    if jax.process_count() > 1:
      out.append("Partial rollouts: not supported with several JAX processes yet")
    if context.config.deterministic and (context.can is None or context.can.abort):
      out.append("RLConfig.deterministic: Partial rollouts on an engine that aborts requests "
                 "pause at whichever completions arrive first (timing); multi-turn episodes "
                 "on the embedded engine pause between waves")
    return out

  def init(self, context: Context) -> Any:
    config = context.config
    capacity = self.replay_capacity or 4 * config.prompts_per_step * config.samples_per_prompt
    return {"replay": ReplayBuffer.empty(capacity, config.seq_len, config.seq_len),
            "next_group": jnp.zeros((), jnp.int32)}

  def next(self, context: Context, state: RolloutState, step: int,
           gate: Callable[[], None] = no_gate) -> tuple[Made, RolloutState]:
    del gate  # one process: no collectives
    indices, seed, state = draw(context, state, step)
    config, task = context.config, context.task
    size, first = config.samples_per_prompt, int(state.source["next_group"])
    pending = state.source["replay"].trajectories(task.train)
    records = [task.train[int(i)] for i in indices]
    pending += driver.start(
        environment_of(task), [r for r in records for _ in range(size)],
        [rollout.prompt_ids(task, context.tokenizer, r) for r in records for _ in range(size)],
        record_index=np.repeat(indices, size), group=first + np.arange(len(indices) * size) // size,
        sample=np.arange(len(indices) * size) % size)
    started = time.perf_counter()
    received = unfinished = 0
    for iteration in range(self.max_iterations):
      stats = driver.advance(context.engine, environment_of(task), context.tokenizer, pending,
                             context.sampling, seed=seed + iteration * 1_000_003,
                             max_sequence_tokens=config.seq_len + 1, pause=self.pause())
      received, unfinished = received + stats["generated_tokens"], unfinished + stats["unfinished"]
      done, rest = complete_groups(pending)
      if done:
        break
    else:
      raise RuntimeError(f"partial rollouts: no group finished after {self.max_iterations} "
                         f"iterations at step {step}; raise Partial.token_budget "
                         "(finish_fraction) or max_iterations")
    trained, extra = done[:config.prompts_per_step], done[config.prompts_per_step:]
    trajectories = [t for g in trained for t in g]
    generated = time.perf_counter()
    rollout.verify(task, context.tokenizer, trajectories)
    verify_s = time.perf_counter() - generated
    waiting = rest + [t for g in extra for t in g]
    stale = np.array([v < step for t in trajectories for v in t.versions], bool)
    state = state.replace(source={"replay": state.source["replay"].store(waiting),
                                  "next_group": jnp.int32(first + len(indices))})
    metrics = {"generate_s": generated - started, "verify_s": verify_s, "verify_busy_s": verify_s,
               "generation_rounds": 1, "partial_received_tokens": received,
               "partial_aborted": unfinished, "partial_iterations": iteration + 1,
               "replay_size": len(waiting),
               "stale_token_fraction": float(stale.mean()) if stale.size else 0.0}
    return Made(trajectories, metrics), record_stats(state, trajectories, size, step)


class RolloutsFailed(RuntimeError):
  """Making rollouts ahead of the trainer failed (the engine crashed): says at which step."""


class _Stopped(Exception):
  """The loop closed while rollouts were made ahead of it."""


class _Ahead:
  """The thread of one Ahead run: makes each step's rollouts with `inner`, step p's once the
  engine holds weights of version >= p - max_staleness, and hands them to `next`."""

  def __init__(self, inner, context: Context, state: RolloutState, step: int,
               max_staleness: int):
    self._inner, self._max_staleness = inner, max_staleness
    self._made: queue.Queue = queue.Queue()
    self._version = step  # the engine holds the weights of the step to train
    self._awaited: int | None = None  # the step whose rollouts the trainer waits for
    self._changed = threading.Condition()
    self._stopped = False
    threading.Thread(target=self._run, args=(context, state, step), daemon=True,
                     name="rollouts-ahead").start()

  def _run(self, context: Context, state: RolloutState, step: int) -> None:
    try:
      while True:
        waiting = time.perf_counter()
        with self._changed:
          self._changed.wait_for(
              lambda: self._stopped or self._version >= step - self._max_staleness)
          if self._stopped:
            return
        waited = time.perf_counter() - waiting
        made, state = self._inner.next(context, state, step,
                                       gate=lambda step=step: self._collectives(step))
        made.metrics["engine_idle_s"] = waited
        self._made.put((made, state))
        step += 1
    except _Stopped:
      return
    except Exception as e:  # noqa: BLE001 - raised on the trainer's thread by next()
      failed = RolloutsFailed(f"rollouts for RL step {step + 1}, made ahead of the trainer, "
                              f"failed: {type(e).__name__}: {e}")
      failed.__cause__ = e
      self._made.put(failed)

  def _collectives(self, step: int) -> None:
    """Returns once the trainer waits for `step`'s rollouts (its thread then issues no
    collectives); _Stopped if the loop closes first."""
    with self._changed:
      self._changed.wait_for(lambda: self._stopped or self._awaited == step)
      if self._stopped:
        raise _Stopped

  def next(self, step: int) -> tuple[Made, RolloutState]:
    with self._changed:
      self._awaited = step
      self._changed.notify_all()
    made = self._made.get()
    if isinstance(made, RolloutsFailed):
      raise made
    return made

  def synced(self, version: int) -> None:
    with self._changed:
      self._version = version
      self._changed.notify_all()

  def stop(self) -> None:
    """No more steps are started (one being made finishes and is dropped)."""
    with self._changed:
      self._stopped = True
      self._changed.notify_all()


@dataclasses.dataclass
class Ahead(Source):
  """Rollouts ahead of the trainer (AReaL, slime, verl's one-step-off): `inner`'s rollouts for
  step t + 1 (up to t + max_staleness) are made on a thread while step t trains, on the
  engine's own copy of the weights; step p's start once the engine holds weights of version
  >= p - max_staleness, so no token trained at step p is older than that (an engine's
  generate reads its weights once per call; on servers a weight sync lets the requests in
  flight finish on the old weights, tagged so, and holds new ones until it is done). With
  several JAX processes the collectives of step p's rollouts (gathering the completions)
  wait until the trainer waits for them: the two threads never issue collectives at once, so
  every process issues them in the same order; each step's generation still runs while the
  step before it trains. The thread starts at the first `next` and stops at `close` (the
  loop's generator closes it)."""
  inner: Any = dataclasses.field(default_factory=Lockstep)
  max_staleness: int = 1
  concurrent = True

  def __post_init__(self):
    self._ahead: _Ahead | None = None

  def init(self, context: Context) -> Any:
    return self.inner.init(context)

  def refusals(self, context: Context) -> list[str]:
    out = []
    if self.max_staleness < 1:
      out.append(f"Ahead.max_staleness={self.max_staleness} must be >= 1 (lockstep: "
                 "rollouts = @Lockstep())")
    if context.config.weight_sync_every > 1:
      out.append(f"RLConfig.weight_sync_every={context.config.weight_sync_every} runs in "
                 "lockstep only; Ahead bounds the staleness by timing instead: choose one")
    if context.can is not None and not context.can.pause:
      out.append("Ahead needs an engine that takes weights while it generates "
                 "(Capabilities.pause)")
    if isinstance(self.inner, (Ahead, Partial)):
      out.append(f"Ahead over {type(self.inner).__name__}: not supported yet (rollouts ahead "
                 "of the trainer run over Lockstep or DynamicSampling)")
    if context.config.deterministic:
      out.append("RLConfig.deterministic: rollouts Ahead of the trainer start each step on "
                 "whichever weights the engine holds by then (timing); use Lockstep, with "
                 "RLConfig.weight_sync_every for staleness fixed by the schedule")
    return out + self.inner.refusals(context)

  def next(self, context: Context, state: RolloutState, step: int,
           gate: Callable[[], None] = no_gate) -> tuple[Made, RolloutState]:
    del gate  # this source's own thread waits its turn
    if self._ahead is None:
      self._ahead = _Ahead(self.inner, context, state, step, self.max_staleness)
    return self._ahead.next(step)

  def synced(self, version: int) -> None:
    if self._ahead is not None:
      self._ahead.synced(version)

  def close(self) -> None:
    if self._ahead is not None:
      self._ahead.stop()
      self._ahead = None


def _hybrid_refusals(source: Source, context: Context) -> list[str]:
  """Why RLConfig.hybrid cannot run with `source` in `context`: the engine releases its
  memory after each generation and takes it back with each step's weights."""
  config, out = context.config, []
  if not config.hybrid:
    return out
  if source.concurrent:
    out.append("RLConfig.hybrid takes turns on the accelerators: rollouts Ahead of the trainer "
               "generate while it trains")
  if config.weight_sync_every != 1:
    out.append(f"RLConfig.hybrid: the engine takes its memory back with each step's weights, so "
               f"weight_sync_every must be 1, not {config.weight_sync_every}")
  if context.can is not None and not context.can.release_memory:
    out.append("RLConfig.hybrid needs an engine that releases its memory "
               "(Capabilities.release_memory)")
  return out


def _length_refusals(context: Context) -> list[str]:
  """Why a run's sequences do not fit its engine: a trajectory's prompt and continuation hold
  up to seq_len + 1 tokens (a row's room), and an SGLang server refuses a request whose input
  + max_new_tokens exceed its context length with a 400 (tokenizer_manager.py L1351-1377),
  which would fail the first generate call that reached the bound."""
  limit = context.can.context_length if context.can is not None else None
  need = context.config.seq_len + 1
  if limit is None or need <= limit:
    return []
  return [f"RLConfig.seq_len = {context.config.seq_len} lets a request hold {need} tokens "
          f"(prompt + completion), above the servers' context length of {limit} (SGLang "
          f"refuses it: tokenizer_manager.py L1351-1377); start them with --context-length "
          f">= {need} or lower seq_len"]


def check(source: Source, context: Context) -> None:
  """ConfigError listing why `source` cannot run in `context`, if it cannot: the one rule for
  every combination of sources, engine, task and sizes."""
  reasons = (source.refusals(context) + _hybrid_refusals(source, context)
             + _length_refusals(context))
  if reasons:
    raise ConfigError("rollouts cannot run: " + "; ".join(reasons))
