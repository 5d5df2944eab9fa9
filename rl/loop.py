"""The RL loop: a Python generator of steps over explicit state.

Owns the order of one RL step and the state it threads:

    rollouts from the source (rl/sources.py: whole groups, verified)
      -> reward transforms and the KL in the reward, once, on exactly the trained groups
      -> advantages -> minibatches of packed rows (rl/batch.py, the optional fields read)
      -> the off-policy correction of each minibatch (rl/corrections.py)
      -> one train step per minibatch -> the engine's weights (every weight_sync_every steps)

`LoopState` is everything a resumed run needs (saved whole by rl/checkpoint.py), `Parts` what
the generator runs with, `StepRecord` what it yields. The generator does no I/O, so a notebook
drives it a few steps at a time; rl/trainer.py builds a run's parts and drives the same
generator with hooks (evaluation, checkpoints, monitors, logs).
"""

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import distributed
from models import lora
from models import sharding
from rl import advantages as advantages_lib
from rl import batch as batch_lib
from rl import corrections as corrections_lib
from rl import distill
from rl import rewards as rewards_lib
from rl import sources
from rl.config import KLReward
from rl.envs.base import environment_of, episode_metrics, multi_turn
from rl.losses import BoundLoss
from rl.train_step import TrainState, init_train_state
from rl.trajectory import column, rollouts_view


@flax.struct.dataclass
class LoopState:
  """Everything a resumed run needs; saved whole by rl/checkpoint.py."""
  step: jax.Array  # i32[] RL steps (rollout batches) done; the engine's weight version
  train: TrainState  # train.step counts optimizer updates (minibatches per RL step)
  reward_state: Any
  rollout: sources.RolloutState  # advanced by the rollout source (ahead: on its thread)


@dataclasses.dataclass
class StepRecord:
  """What one RL step yields: the new state, scalar metrics, the trajectories trained on, and
  their rewards and advantages (before the per-token broadcast), f32[N] each."""
  step: int
  state: LoopState
  metrics: dict[str, float]
  trajectories: list
  rewards: np.ndarray
  advantages: np.ndarray


@dataclasses.dataclass(frozen=True)
class Parts:
  """What `rl_steps` runs with (rl.trainer.build makes them from a run's configuration).

  context: the engine, task, tokenizer, sizes and prompt sampler the rollout source uses.
  rollouts: the rollout source. loss: the bound loss the train step optimizes (its `reads`
  say which optional batch fields to fill). train_step: `(TrainState, TrainBatch,
  ref_params) -> (TrainState, metrics)` (rl.train_step.make_train_step, with the same loss).
  reward: the reward transform; advantage: a key of rl.advantages.ESTIMATORS.
  correction: the off-policy correction of each minibatch; trainer_logprobs: `(params,
  TrainBatch) -> f32[rows, seq]`, for a correction that needs the trainer's log-probs and,
  whenever given, for the mismatch every step logs (one forward pass per minibatch).
  kl_reward: KL to the reference in the reward, with reference_logprobs: `TrainBatch ->
  f32[rows, seq]` under the reference. ref_params: to the train step (a loss reading
  ref_logp). teachers: score every trajectory (a loss reading teacher_logp). base: a LoRA
  run's frozen base (models/lora.py): TrainState.params are then its adapters, the policy
  `policy(parts, params)`, and train_step and trainer_logprobs attach them themselves.
  """
  context: sources.Context
  rollouts: Any
  loss: BoundLoss
  train_step: Callable
  reward: rewards_lib.RewardTransform
  advantage: str
  correction: corrections_lib.Correction = dataclasses.field(
      default_factory=corrections_lib.keep)
  trainer_logprobs: Optional[Callable] = None
  kl_reward: Optional[KLReward] = None
  reference_logprobs: Optional[Callable] = None
  ref_params: Any = None
  teachers: Optional[distill.Teachers] = None
  base: Any = None

  @property
  def reads(self) -> frozenset[str]:
    """The optional TrainBatch fields the step fills: those its loss and correction read."""
    return self.loss.reads | self.correction.reads

  def check(self) -> None:
    """ValueError for parts that cannot run together."""
    if self.kl_reward is not None and self.kl_reward.coef and self.reference_logprobs is None:
      raise ValueError("a KLReward needs reference_logprobs (TrainBatch -> f32[rows, seq] "
                       "log-probs under the reference policy)")
    if self.correction.trainer_logp and self.trainer_logprobs is None:
      raise ValueError(f"the correction {self.correction.name!r} needs trainer_logprobs")
    if "teacher_logp" in self.reads and self.teachers is None:
      raise ValueError(f"loss {self.loss.name!r} reads teacher log-probs: give Parts.teachers")


def init_state(params, optimizer: optax.GradientTransformation, parts: Parts,
               seed: int) -> LoopState:
  """The state before the first RL step."""
  return LoopState(jnp.zeros((), jnp.int32), init_train_state(params, optimizer),
                   parts.reward.init(),
                   sources.init_state(parts.context, parts.rollouts, seed))


@functools.lru_cache(maxsize=None)
def rl_optimizer(learning_rate: float, *, max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0,
                 frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
  """AdamW after a global-norm clip; one object per setting, so that the runs of one process
  share compiled train steps (rl.trainer). The params' top-level subtrees named in `frozen`
  (e.g. "visual", a vision tower) get zero gradients, before the clip, and never move."""
  chain = [optax.clip_by_global_norm(max_grad_norm),
           optax.adamw(learning_rate, weight_decay=weight_decay)]
  if frozen:
    mask = lambda params: {k: jax.tree.map(lambda _: k in frozen, v) for k, v in params.items()}
    chain.insert(0, optax.masked(optax.set_to_zero(), mask))
  return optax.chain(*chain)


def rl_steps(state: LoopState, parts: Parts) -> Iterator[StepRecord]:
  """Run RL steps forever from `state`, yielding a StepRecord after each.

  Each step makes RLConfig.minibatches optimizer updates, each on a share of whole groups;
  after the step the engine gets the new weights (version = RL step), or after every
  weight_sync_every-th step only. With several JAX processes every process runs this
  generator: the rollouts reach every process (rl.sources), and the rest of the step is the
  same computation everywhere, the train step on the global mesh; an error in process 0's
  calls to the servers is raised on every process (models.distributed.checked).
  Each StepRecord's metrics break the step's time down: generate_s, verify_s (the wait for
  verification once generation ended; verify_busy_s is the verifier's whole time), score_s
  (drawing prompts, reward transforms, statistics), pack_s, train_s, weight_sync_s, and
  trainer_idle_s / engine_idle_s, how long each waited for the other. With RLConfig.hybrid,
  the switches between them: offload_s (the train state to pinned host memory, before
  generating), release_s (the engine frees its weights and KV cache, after), reload_s (the
  train state back on the devices), and switch_to_train_s = release_s + reload_s,
  switch_to_inference_s = offload_s + weight_sync_s (the engine takes its memory back with
  the new weights).
  Close the generator (`.close()`) to stop a source that runs ahead. A `train_step` made
  with donate_state=True (as rl.trainer makes it) updates the state in place: the state of
  an earlier StepRecord, and the engine's weights until the step's update_weights, are then
  deleted arrays. Keep copies (jax.tree.map(jnp.copy, ...)) of the states a notebook wants to
  look at later, or use a copying train step.
  """
  parts.check()
  source = parts.rollouts
  if _engine_copies(parts):  # the engine's own copy
    sync_engine(parts, state.train.params, int(state.step), parts.rollouts.concurrent)
  try:
    while True:
      step = int(state.step)
      switch: dict[str, float] = {}
      if parts.context.config.hybrid:  # the engine's turn: the train state to host memory
        state, switch["offload_s"] = _timed(lambda: state.replace(
            train=sharding.in_memory(state.train, "pinned_host")))
      started = time.perf_counter()
      made, rollout_state = source.next(parts.context, state.rollout, step)
      waited = time.perf_counter() - started
      if parts.context.config.hybrid:  # the trainer's: the engine frees its memory
        engine = parts.context.engine
        switch["release_s"] = distributed.checked(
            lambda: engine.release_memory() if engine is not None else 0.0)
        state, switch["reload_s"] = _timed(lambda: state.replace(
            train=sharding.in_memory(state.train, "device")))
      record = _step(parts, state.replace(rollout=rollout_state), made, step, waited, switch)
      state = record.state
      yield record
  finally:
    source.close()


def _timed(make):
  """(make(), the seconds it took)."""
  started = time.perf_counter()
  made = make()
  return made, time.perf_counter() - started


@dataclasses.dataclass
class Scored:
  """One step's rollouts ready to pack: trajectories, rewards f32[N] and advantages f32[N]
  (before the per-token broadcast), keep bool[N] (the loss mask), the optional fields the
  step reads, the reward transforms' new state, and the metrics so far."""
  trajectories: list
  rewards: np.ndarray
  advantages: np.ndarray
  keep: np.ndarray
  fields: dict
  reward_state: Any
  metrics: dict


def _step(parts: Parts, state: LoopState, made: sources.Made, step: int,
          waited_s: float, switch: dict[str, float]) -> StepRecord:
  """Step `step`'s update on the rollouts `made`: rewards, advantages, batches, train step,
  weight sync. `waited_s`: how long the trainer waited for the rollouts; `switch`: the
  hybrid deployment's offload_s, release_s and reload_s (rl_steps)."""
  scored = score(parts, state.reward_state, made, step, waited_s)
  corrected, measured, pack_s = corrected_minibatches(parts, state.train.params, scored, step)
  train, per_update, train_s = train_on(parts, state.train, corrected)
  metrics = {**scored.metrics, **update_metrics(per_update, measured, corrected, pack_s, train_s)}
  started = time.perf_counter()
  if (step + 1) % parts.context.config.weight_sync_every == 0:
    sync_engine(parts, train.params, step + 1, parts.rollouts.concurrent)
    parts.rollouts.synced(step + 1)
  metrics["weight_sync_s"] = time.perf_counter() - started
  if switch:
    metrics.update(switch, switch_to_train_s=switch["release_s"] + switch["reload_s"],
                   switch_to_inference_s=switch["offload_s"] + metrics["weight_sync_s"])
  finish_metrics(parts, metrics, scored, waited_s, step)
  state = state.replace(step=jnp.int32(step + 1), train=train, reward_state=scored.reward_state)
  return StepRecord(step + 1, state, metrics, scored.trajectories, scored.rewards,
                    scored.advantages)


def score(parts: Parts, reward_state, made: sources.Made, step: int,
          waited_s: float) -> Scored:
  """The rollouts `made` scored: reward transforms (from `reward_state`), the KL in the
  reward, advantages, the fields the loss and correction read (teachers' scores included);
  metrics: the source's, and score_s."""
  started = time.perf_counter()
  trajectories = made.trajectories
  rollouts, reward_state = parts.reward.update(rollouts_view(trajectories), reward_state,
                                               step=step)
  if parts.kl_reward is not None and parts.kl_reward.coef:
    rollouts = rollouts.replace(reward=rollouts.reward - parts.kl_reward.coef * (
        batch_lib.sequence_kl(trajectories, parts.reference_logprobs, parts.kl_reward,
                              parts.context.config, parts.context.vision)))
  advantage_fn = advantages_lib.ESTIMATORS[parts.advantage]
  episodes = [(t.group, t.sample) for t in trajectories]
  if len(set(episodes)) < len(episodes):  # an agent episode's branches share theirs
    adv = np.asarray(advantages_lib.per_episode(
        advantage_fn, rollouts.reward, rollouts.group_ids, rollouts.num_groups,
        np.unique(np.asarray(episodes), axis=0, return_inverse=True)[1].reshape(-1)))
  else:
    adv = np.asarray(advantage_fn(rollouts.reward, rollouts.group_ids, rollouts.num_groups))
  metrics = dict(made.metrics)
  metrics.setdefault("generate_s", 0.0)
  metrics.setdefault("verify_s", 0.0)
  metrics["score_s"] = time.perf_counter() - started + (
      0.0 if parts.rollouts.concurrent else max(
          0.0, waited_s - metrics["generate_s"] - metrics["verify_s"]))
  fields = batch_lib.trajectory_fields(trajectories, parts.reads)
  if parts.teachers is not None:
    teacher, teacher_metrics = distill.teacher_fields(parts.teachers, trajectories, parts.reads)
    fields.update(teacher)
    metrics.update(teacher_metrics)
  return Scored(trajectories, np.asarray(rollouts.reward), adv, np.asarray(rollouts.loss_mask),
                fields, reward_state, metrics)


def corrected_minibatches(parts: Parts, params, scored: Scored, step: int):
  """The step's minibatches of packed rows, each corrected (parts.correction) against the
  trainer's log-probs under train state params `params` (the step's starting ones). Returns
  (minibatches, each one's mismatch and correction metrics, the seconds it took)."""
  started = time.perf_counter()
  batches = batch_lib.minibatches(scored.trajectories, scored.advantages,
                                  batch_lib.train_masks(scored.trajectories, scored.keep),
                                  parts.context.config, scored.fields, parts.context.vision)
  corrected, measured = [], []
  for batch in batches:
    # The step's starting params for every minibatch: the PPO ratio of a later minibatch then
    # sees the updates before it, and the engine mismatch is the engine's. All before the
    # first update, which may take (donate) those params' buffers.
    # (Parts.check: a correction that reads them has trainer_logprobs.)
    trainer_logp = (None if parts.trainer_logprobs is None
                    else parts.trainer_logprobs(params, batch))
    mismatch = {} if trainer_logp is None else corrections_lib.measure(batch, trainer_logp)
    batch, correction_metrics = parts.correction.apply(batch, step=step,
                                                       trainer_logp=trainer_logp)
    corrected.append(batch)
    measured.append({**mismatch, **correction_metrics})
  return corrected, measured, time.perf_counter() - started


def train_on(parts: Parts, train: TrainState, batches):
  """One update of `train` on each minibatch. Returns (the new TrainState, each update's
  metrics on the host, the seconds it took)."""
  started = time.perf_counter()
  per_update = []
  for batch in batches:
    train, update_metrics = parts.train_step(train, batch, parts.ref_params)
    per_update.append(update_metrics)
  return train, jax.device_get(per_update), time.perf_counter() - started


def update_metrics(per_update, measured, batches, pack_s: float, train_s: float) -> dict:
  """A step's update metrics: pack_s, train_s, rows, the train step's means over updates
  (logp_diff_max: their max), the correction's metrics, and the engine-vs-trainer mismatch
  before the first update: with trainer_logprobs every minibatch's (corrections.measure:
  |d|, KL, ratio percentiles, what each mask would drop), else |trainer - engine| of the first
  update's (engine_logp_diff_mean / _max)."""
  metrics = {k: float(np.mean([m[k] for m in per_update])) for k in per_update[0]}
  metrics["logp_diff_max"] = float(max(m["logp_diff_max"] for m in per_update))
  # Trainer vs engine log-probs on the same tokens, before this step's first update.
  metrics["engine_logp_diff_mean"] = float(per_update[0]["logp_diff_mean"])
  metrics["engine_logp_diff_max"] = float(per_update[0]["logp_diff_max"])
  metrics.update(corrections_lib.combine(measured))
  metrics.update(pack_s=pack_s, train_s=train_s,
                 rows=sum(batch.tokens.shape[0] for batch in batches))
  return metrics


def finish_metrics(parts: Parts, metrics: dict, scored: Scored, waited_s: float,
                   step: int) -> None:
  """Adds to a step's `metrics` (weight_sync_s among them) the idle times and the rollouts'
  numbers (_rollout_metrics)."""
  metrics["trainer_idle_s"] = waited_s
  metrics.setdefault("engine_idle_s", metrics["pack_s"] + metrics["train_s"] + metrics[
      "weight_sync_s"] + metrics.get("teacher_s", 0.0))
  metrics.update(_rollout_metrics(parts, scored.trajectories, scored.rewards, step))


def _rollout_metrics(parts: Parts, trajectories, rewards: np.ndarray, step: int) -> dict:
  """The step's rollouts in numbers: reward, accuracy, lengths, staleness (versions behind
  the policy being trained: at most max_staleness ahead, 0 in lockstep, more only for
  partial rollouts' resumed trajectories) and, for episodes, their turns and tool use."""
  versions = np.concatenate([np.asarray(t.versions, np.int64) for t in trajectories])
  metrics = {"step": step + 1, "reward": float(rewards.mean()),
             "accuracy": float(column(trajectories, "correct", bool).mean()),
             "completion_length": float(column(trajectories, "policy_count", np.int32).mean()),
             "truncated": float(column(trajectories, "truncated", bool).mean()),
             "well_formed": float(column(trajectories, "well_formed", bool).mean()),
             "groups_trained": len({t.group for t in trajectories}),
             "staleness_max": int(step - versions.min()) if versions.size else 0}
  if multi_turn(environment_of(parts.context.task)):
    metrics.update(episode_metrics([t.episode() for t in trajectories]))
  return metrics


def _engine_copies(parts: Parts) -> bool:
  """Whether an engine that keeps the arrays it is given needs a copy of its own: when a
  train step, or the hybrid deployment's move of the train state to host memory, would take
  (donate, delete) the trainer's buffers while the engine still reads them (rollouts ahead
  of the trainer, weights kept for several steps, a hybrid step's generation)."""
  config, engine = parts.context.config, parts.context.engine
  return parts.rollouts.concurrent or config.weight_sync_every > 1 or (
      config.hybrid and engine is not None and engine.capabilities.keeps_weight_arrays)


def policy(parts: Parts, params):
  """The policy's params from the train state's: a LoRA run's adapters attached to its base
  (no copy), else the params themselves."""
  return params if parts.base is None else lora.attach(parts.base, params)


def plain_policy(parts: Parts, params):
  """The policy of train state params `params` as plain weights (a LoRA run's merged: fresh
  arrays), what an engine, an evaluation or an export takes."""
  return params if parts.base is None else lora.merged(parts.base, params)


def sync_engine(parts: Parts, params, version: int, while_generating: bool = False, *,
                arm: int | None = None) -> None:
  """The engine gets the policy of train state params `params` as `version`, its requests in
  flight aborted or, `while_generating`, finishing on the weights they started with (taking
  back the memory it released, in a hybrid deployment): a LoRA run's adapters alone when the
  engine takes adapters (Capabilities.adapters: servers; `arm`: an arm's, rl/arms.py, under
  its arm's name), its base once; else plain_policy's weights. With several processes, an
  engine on each gets a whole copy of them; one that keeps the arrays it is given gets a copy
  of its own when _engine_copies says so (merged ones are already its own)."""
  engine = parts.context.engine
  if parts.base is not None and engine is not None and engine.capabilities.adapters:
    adapters = distributed.local_copy(params)
    distributed.checked(lambda: engine.update_adapters(
        adapters, parts.context.config.lora, version,
        base=lambda: distributed.local_copy(parts.base), while_generating=while_generating,
        arm=arm))
    return
  whole = distributed.local_copy(plain_policy(parts, params))
  if (parts.base is None and _engine_copies(parts) and engine is not None
      and engine.capabilities.keeps_weight_arrays):
    whole = jax.tree.map(jnp.copy, whole)
  distributed.checked(lambda: engine and engine.update_weights(
      whole, version=version, while_generating=while_generating))
