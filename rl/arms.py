"""Arms: K experiments over one frozen base at once, each a LoRA run of its own.

An arm is what one LoRA run trains: its adapters (from its own seed), its optimizer state and
its learning rate. K arms are held stacked, every leaf with a leading arm axis [K, ...], so
that one program updates them all over the one base (rl/train_step.make_train_step with
arms=True: the step vmapped over the arms, the base shared, its products batched), and one
batch of decoding could serve them all (models/lora.attach with each row's arm; SGLang's
LoRA batching on servers): arms_steps generates one arm after another for now.

Owns stacking and unstacking arms, their optimizer (rl/loop.rl_optimizer's, with its learning
rate held in each arm's optimizer state), the padding that gives K arms' minibatches one
shape, each arm's PEFT export, and `arms_steps`: rl/loop.rl_steps for K arms in lockstep,
each arm's step the step it would make alone but for the one update they share.
"""

import os
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import hf_lora, lora
from models.config import ModelConfig
from rl import loop, sources
from rl.loop import rl_optimizer
from rl.train_step import TrainState, init_train_state
from rl.types import TrainBatch


def stack(trees: Sequence[Any]) -> Any:
  """K pytrees of one structure as one whose every leaf is [K, ...]."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree, arm: int):
  """Arm `arm`'s pytree of a stacked one."""
  return jax.tree.map(lambda x: x[arm], tree)


def arms_optimizer(*, max_grad_norm: float = 1.0,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  """rl_optimizer's AdamW after a global-norm clip, its learning rate in the optimizer state
  (optax.inject_hyperparams), so that each arm of a stacked state has its own (init_arms);
  vmapped over the arms, the clip is each arm's own."""
  # rl_optimizer's own chain (unwrapped from its cache, which a traced rate cannot key).
  return optax.inject_hyperparams(rl_optimizer.__wrapped__,
                                  static_args=("max_grad_norm", "weight_decay"))(
      learning_rate=0.0, max_grad_norm=max_grad_norm, weight_decay=weight_decay)


def init_arms(adapters: Sequence[Any], learning_rates: Sequence[float],
              optimizer: optax.GradientTransformation) -> TrainState:
  """The stacked TrainState of K arms: arm k trains adapters[k] at learning_rates[k], with
  `optimizer` an arms_optimizer."""
  if len(adapters) != len(learning_rates):
    raise ValueError(f"arms: {len(adapters)} adapters and {len(learning_rates)} learning rates")
  states = []
  for trained, rate in zip(adapters, learning_rates):
    state = init_train_state(trained, optimizer)
    hyperparams = dict(state.opt_state.hyperparams, learning_rate=jnp.float32(rate))
    states.append(state.replace(opt_state=state.opt_state._replace(hyperparams=hyperparams)))
  return stack(states)


def learning_rates(state: TrainState) -> np.ndarray:
  """f32[K]: each arm's learning rate in a stacked state made by init_arms."""
  return np.asarray(state.opt_state.hyperparams["learning_rate"])


def stack_batches(batches: Sequence[TrainBatch]) -> TrainBatch:
  """K arms' minibatches as one [K, rows, ...], each padded to the most rows any has with
  rows of padding (zeros: segment 0, no loss), as rl/packing.pack pads its own."""
  rows = max(batch.tokens.shape[0] for batch in batches)
  pad = lambda x: np.pad(np.asarray(x), [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return jax.tree.map(lambda *leaves: np.stack([pad(x) for x in leaves]), *batches)


def export_adapters(state: TrainState, cfg: ModelConfig, lora_cfg: lora.LoraConfig,
                    out_dir: str, *, base: str | None = None) -> list[str]:
  """Each arm's adapters of a stacked train state as a PEFT directory out_dir/arm_<k>
  (models/hf_lora.save_adapter; `base`: the base model's path, recorded in each). Returns
  their paths."""
  return [hf_lora.save_adapter(unstack(state.params, k), cfg, lora_cfg,
                               os.path.join(out_dir, f"arm_{k}"), base=base)
          for k in range(jax.tree.leaves(state.params)[0].shape[0])]


def init_arms_state(adapters: Sequence[Any], learning_rates: Sequence[float],
                    seeds: Sequence[int], optimizer: optax.GradientTransformation,
                    parts: loop.Parts) -> loop.LoopState:
  """K arms' loop state before their first RL step: the stacked train state (init_arms) and
  each arm's reward state and rollout state, the latter from seeds[k] as rl/loop.init_state
  makes a run's (its prompts and generation seeds are then the ones that run alone draws)."""
  if len(seeds) != len(adapters):
    raise ValueError(f"arms: {len(adapters)} adapters and {len(seeds)} seeds")
  return loop.LoopState(jnp.zeros((), jnp.int32), init_arms(adapters, learning_rates, optimizer),
                        [parts.reward.init() for _ in seeds],
                        [sources.init_state(parts.context, parts.rollouts, s) for s in seeds])


def _check(parts: loop.Parts) -> None:
  """ValueError for parts arms cannot run with (yet)."""
  config, engine = parts.context.config, parts.context.engine
  refusals = [why for refused, why in (
      (parts.base is None, "arms are LoRA runs over one base: give Parts.base"),
      (parts.rollouts.concurrent, "arms generate in lockstep; a source running ahead of the "
       "trainer cannot (sources.Lockstep, or DynamicSampling over it)"),
      (config.hybrid, "arms do not run in a hybrid deployment (RLConfig.hybrid) yet"),
      (config.weight_sync_every != 1, f"arms sync every step (RLConfig.weight_sync_every is "
       f"{config.weight_sync_every})"),
      (engine is None, "arms generate on an engine (Context.engine is None)"),
      (engine is not None and engine.capabilities.adapters and config.lora is None,
       "arms on servers sync their adapters as PEFT directories: give RLConfig.lora (the "
       "arms' LoraConfig)")) if refused]
  if refusals:
    raise ValueError("; ".join(refusals))


def arms_steps(state: loop.LoopState, parts: loop.Parts) -> Iterator[list[loop.StepRecord]]:
  """Run K arms' RL steps forever from `state` (init_arms_state's, or one restored),
  yielding after each step the K arms' StepRecords (each holding the arms' joint state).

  parts: a LoRA run's (Parts.base its frozen base), its train_step made with arms=True.
  Arm k's step is rl_steps' step of a run alone: the engine gets arm k's policy (the embedded
  engine its merged weights; servers its adapters, under arm k's own name, which its
  requests then name), then its rollouts are generated, scored, packed and corrected as that
  run's would be; the K arms' minibatches then go through one vmapped update each. Each
  record's metrics are its arm's; train_s is the shared updates' time.
  """
  parts.check()
  _check(parts)
  try:
    while True:
      step, arms = int(state.step), len(state.rollout)
      scored, rollout_states, minibatches, measured, pack_s, sync_s, waited = (
          [], [], [], [], [], [], [])
      for k in range(arms):
        params = unstack(state.train.params, k)
        started = time.perf_counter()
        loop.sync_engine(parts, params, step, arm=k)  # its policy, on the one engine
        sync_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        made, rollout_state = parts.rollouts.next(parts.context, state.rollout[k], step)
        waited.append(time.perf_counter() - started)
        rollout_states.append(rollout_state)
        scored.append(loop.score(parts, state.reward_state[k], made, step, waited[k]))
        batches, arm_measured, arm_pack_s = loop.corrected_minibatches(parts, params, scored[k],
                                                                       step)
        minibatches.append(batches)
        measured.append(arm_measured)
        pack_s.append(arm_pack_s)
      train, per_update, train_s = loop.train_on(
          parts, state.train, [stack_batches(batches) for batches in zip(*minibatches)])
      state = state.replace(step=jnp.int32(step + 1), train=train,
                            reward_state=[s.reward_state for s in scored], rollout=rollout_states)
      records = []
      for k in range(arms):
        updates = [{name: value[k] for name, value in update.items()} for update in per_update]
        metrics = {**scored[k].metrics, **loop.update_metrics(
            updates, measured[k], minibatches[k], pack_s[k], train_s), "weight_sync_s": sync_s[k]}
        loop.finish_metrics(parts, metrics, scored[k], waited[k], step)
        records.append(loop.StepRecord(step + 1, state, metrics, scored[k].trajectories,
                                       scored[k].rewards, scored[k].advantages))
      yield records
  finally:
    parts.rollouts.close()
