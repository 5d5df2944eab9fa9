"""Supervised fine-tuning: the warm start on a task's reference solutions (so RL starts from
non-zero reward) or on a JSONL of chat demonstrations (loss on the assistant's tokens only),
and SFT on any list of (prompt, completion) token ids (long2short's shortest rejection
sampling).

Owns the SFT batches (prompt + completion, loss on the completion) and the short loop over
them; the update itself is rl/train_step.py with the `nll` loss.
"""

from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from models import distributed, sharding
from models.config import ModelConfig, VisionConfig
from rl import losses
from rl.envs import encode_text, environment_of, multi_turn
from rl.rollout import prompt_ids
from rl.packing import trajectory_batch
from rl.tasks.jsonl import read_records
from rl.train_step import init_train_state, make_train_step

# An SFT example: (prompt token ids, target token ids with <eos> where the model should
# stop), optionally with a bool mask over the targets (False: in the sequence, out of the
# loss, e.g. an agentic demonstration's observation tokens; None: all in), and the prompt's
# images (raw, in the order of its image tokens) for a vision-language model.
Example = tuple[Sequence, ...]


def sft_batches(example: Callable[[int], Example], num_examples: int, *, batch_size: int,
                seq_len: int, seed: int, row_multiple: int = 8,
                vision_cfg: VisionConfig | None = None) -> Iterator:
  """Endless packed TrainBatches of examples `example(i)`, i drawn uniformly from
  [0, num_examples); with images (a vision-language model's `vision_cfg`)."""
  rng = np.random.default_rng(seed)
  while True:
    examples = [example(int(i)) for i in rng.integers(0, num_examples, batch_size)]
    prompts, targets = [e[0] for e in examples], [e[1] for e in examples]
    masks = [True if len(e) < 3 or e[2] is None else e[2] for e in examples]
    images = [e[3] if len(e) == 4 else [] for e in examples]
    zeros = [np.zeros(len(t), np.float32) for t in targets]
    batch, _ = trajectory_batch(prompts, targets, zeros, [0.0] * batch_size, masks, seq_len,
                                row_multiple=row_multiple, images=images,
                                vision_cfg=vision_cfg)
    yield batch


def fit(params, cfg: ModelConfig, example: Callable[[int], Example], num_examples: int, *,
        steps: int, batch_size: int = 64, learning_rate: float = 3e-3, seq_len: int = 128,
        seed: int = 0, progress: bool = True, desc: str = "SFT", mesh=None):
  """`steps` AdamW updates (warm-up, then cosine decay) of the NLL of examples `example(i)`.
  Returns (params, final loss). With `mesh` (models.sharding.make_mesh) the params and
  optimizer state are sharded over it and the steps run on it; the examples are drawn alike
  on every process of a multi-process mesh."""
  if num_examples < 1:
    raise ValueError(f"{desc}: no examples to fit")
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20),
                                         max(steps, 2)),
      weight_decay=0.0))
  # Updated in place (donated), from a copy: the caller's `params` stay theirs.
  state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
  shardings = None
  if mesh is not None:
    shardings = sharding.state_shardings(state, optimizer, mesh)
    state = jax.device_put(distributed.replicated(state, mesh), shardings)
  step_fn = sharding.on_mesh(mesh, make_train_step(cfg, optimizer, losses.nll,
                                                   state_shardings=shardings,
                                                   donate_state=True))
  batches = sft_batches(example, num_examples, batch_size=batch_size, seq_len=seq_len,
                        seed=seed, vision_cfg=cfg.vision)
  loss = float("nan")
  bar = tqdm(total=steps, desc=desc, disable=not progress, dynamic_ncols=True)
  for _ in range(steps):
    state, metrics = step_fn(state, next(batches))
    loss = float(metrics["loss"])
    bar.set_postfix(loss=f"{loss:.3f}")
    bar.update(1)
  bar.close()
  return state.params, loss


def solution_example(task, tokenizer, record) -> Example:
  """The SFT example of `record`'s reference solution. An agentic task (one with an
  `environment`) gives it as `solution_segments(record)`, (text, policy's) spans, encoded as an
  episode's tokens are (no <bos>, no chat template); the observation spans are in the
  sequence and out of the loss (the example's mask)."""
  prompt = prompt_ids(task, tokenizer, record)
  if record.get("images"):
    return prompt, tokenizer.encode(task.solution(record), add_eos=True), None, record["images"]
  if not multi_turn(environment_of(task)):
    return prompt, tokenizer.encode(task.solution(record), add_eos=True)
  targets, mask = [], []
  for text, policy in task.solution_segments(record):
    ids = encode_text(tokenizer, text)
    targets += ids
    mask += [policy] * len(ids)
  return prompt, targets + [tokenizer.eos_id], np.array(mask + [True], bool)


def conversation_example(tokenizer, messages: list[dict[str, Any]], where: str) -> Example:
  """The SFT example of a chat demonstration (models.tokenizer.ChatPrompts
  .encode_conversation): the tokens before the first assistant token are the prompt, those
  from it to the last assistant token the targets, the loss on the assistant's."""
  try:
    ids, mask = tokenizer.encode_conversation(messages)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  if not any(mask):
    raise ValueError(f"{where}: no assistant message to learn from")
  first, last = mask.index(True), len(mask) - mask[::-1].index(True)
  return ids[:first], ids[first:last], np.array(mask[first:last], bool)


def read_demonstrations(path: str, tokenizer) -> list[Example]:
  """The SFT examples of a JSONL file of chat demonstrations, {"messages": [{"role",
  "content"}, ...]} a line (the shape of OpenAI's and TRL's chat datasets)."""

  def convert(record, where):
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
        for m in messages):
      raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    return {"example": conversation_example(tokenizer, messages, where)}

  return [r["example"] for r in read_records(path, ("messages",), convert).records]


def warm_start(params, cfg: ModelConfig, task, tokenizer, *, steps: int, batch_size: int = 64,
               learning_rate: float = 3e-3, seq_len: int = 128, seed: int = 0,
               progress: bool = True, mesh=None):
  """`fit` on the task's reference solutions (task.train, see `solution_example`), on `mesh`
  when given. Returns (params, final loss)."""

  def example(i: int) -> Example:
    return solution_example(task, tokenizer, task.train[i])

  return fit(params, cfg, example, len(task.train), steps=steps, batch_size=batch_size,
             learning_rate=learning_rate, seq_len=seq_len, seed=seed, progress=progress,
             desc="SFT warm start", mesh=mesh)
