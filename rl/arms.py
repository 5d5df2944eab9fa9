"""Arms: K experiments over one frozen base at once, each a LoRA run of its own.

An arm is what one LoRA run trains: its adapters (from its own seed), its optimizer state and
its learning rate. K arms are held stacked, every leaf with a leading arm axis [K, ...], so
that one program updates them all over the one base (rl/train_step.make_train_step with
arms=True: the step vmapped over the arms, the base shared, its products batched) and one
batch of decoding serves them all (models/lora.attach with each row's arm).

Owns stacking and unstacking arms, their optimizer (rl/loop.rl_optimizer's, with its learning
rate held in each arm's optimizer state) and the padding that gives K arms' minibatches one
shape.
"""

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
