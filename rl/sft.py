"""Supervised warm start on a task's reference solutions, so RL starts from non-zero reward.

Owns the SFT batches (prompt + solution + <eos>, loss on the solution) and the short loop
over them; the update itself is rl/train_step.py with the `nll` loss.
"""

from typing import Iterator

import numpy as np
import optax
from tqdm.auto import tqdm

from models.config import ModelConfig
from rl import losses
from rl.eval import prompt_ids
from rl.packing import trajectory_batch
from rl.train_step import init_train_state, make_train_step


def sft_batches(task, tokenizer, *, batch_size: int, seq_len: int, seed: int,
                row_multiple: int = 8) -> Iterator:
  """Endless packed TrainBatches of reference solutions drawn uniformly from task.train."""
  rng = np.random.default_rng(seed)
  while True:
    records = [task.train[int(i)] for i in rng.integers(0, len(task.train), batch_size)]
    prompts = [prompt_ids(task, tokenizer, r) for r in records]
    solutions = [tokenizer.encode(task.solution(r), add_eos=True) for r in records]
    zeros = [np.zeros(len(s), np.float32) for s in solutions]
    batch, _ = trajectory_batch(prompts, solutions, zeros, [0.0] * batch_size,
                                [True] * batch_size, seq_len, row_multiple=row_multiple)
    yield batch


def warm_start(params, cfg: ModelConfig, task, tokenizer, *, steps: int, batch_size: int = 64,
               learning_rate: float = 3e-3, seq_len: int = 128, seed: int = 0,
               progress: bool = True):
  """`steps` AdamW updates (warm-up, then cosine decay) of the SFT loss on the task's
  reference solutions. Returns (params, final loss)."""
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20),
                                         max(steps, 2)),
      weight_decay=0.0))
  step_fn = make_train_step(cfg, optimizer, losses.nll)
  state = init_train_state(params, optimizer)
  batches = sft_batches(task, tokenizer, batch_size=batch_size, seq_len=seq_len, seed=seed)
  loss = float("nan")
  bar = tqdm(total=steps, desc="SFT warm start", disable=not progress, dynamic_ncols=True)
  for _ in range(steps):
    state, metrics = step_fn(state, next(batches))
    loss = float(metrics["loss"])
    bar.set_postfix(loss=f"{loss:.3f}")
    bar.update(1)
  bar.close()
  return state.params, loss

