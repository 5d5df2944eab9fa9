"""Packing variable-length trajectories into fixed-shape rows, and back.

Owns the layout of a `TrainBatch`: first-fit-decreasing placement into rows of `seq_len`,
segment ids (1, 2, ... per row; 0 = padding), positions restarting per segment, and a row
count rounded up to `row_multiple` so that a run compiles a handful of shapes. Preference
pairs (DPO) keep both halves of a pair in one row: segments 2k+1 and 2k+2.
"""

from typing import Mapping, Sequence

import numpy as np

from models import vision
from models.config import VisionConfig
from rl.types import TrainBatch


def pack(sequences: Sequence[dict[str, np.ndarray]], seq_len: int, *, row_multiple: int = 1):
  """Pack sequences (dicts of arrays with the same keys, equally long on their first axis)
  into rows.

  Returns (fields, placements): fields maps each key, plus "segment_ids" and "positions", to
  an array [rows, seq_len, ...] (zeros where nothing is placed); placements[i] = (row, start).
  """
  if not sequences:
    raise ValueError("pack: no sequences")
  lengths = [len(next(iter(s.values()))) for s in sequences]
  too_long = [i for i, n in enumerate(lengths) if n > seq_len]
  if too_long:
    raise ValueError(f"pack: sequence {too_long[0]} has {lengths[too_long[0]]} tokens, more "
                     f"than seq_len={seq_len}; raise seq_len or lower max_new_tokens")
  free: list[int] = []  # room left in each row
  placements: list[tuple[int, int]] = [(0, 0)] * len(sequences)
  for i in sorted(range(len(sequences)), key=lambda i: -lengths[i]):
    row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
    if row is None:
      free.append(seq_len)
      row = len(free) - 1
    placements[i] = (row, seq_len - free[row])
    free[row] -= lengths[i]
  rows = -(-len(free) // row_multiple) * row_multiple
  fields = {k: np.zeros((rows, seq_len) + v.shape[1:], v.dtype)
            for k, v in sequences[0].items()}
  fields["segment_ids"] = np.zeros((rows, seq_len), np.int32)
  fields["positions"] = np.zeros((rows, seq_len), np.int32)
  segments_in_row = [0] * rows
  for seq, (row, start), n in zip(sequences, placements, lengths):
    for k, v in seq.items():
      fields[k][row, start:start + n] = v
    segments_in_row[row] += 1
    fields["segment_ids"][row, start:start + n] = segments_in_row[row]
    fields["positions"][row, start:start + n] = np.arange(n)
  return fields, placements


def unpack(packed: np.ndarray, placements: Sequence[tuple[int, int]],
           lengths: Sequence[int]) -> list[np.ndarray]:
  """The 1-D slices of packed[rows, seq_len] at `placements` with `lengths`."""
  return [packed[row, start:start + n] for (row, start), n in zip(placements, lengths)]


def trajectory_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                     completion_logp: Sequence[np.ndarray], advantages: Sequence[float],
                     train_mask: Sequence, seq_len: int, *, row_multiple: int = 1,
                     token_weights: Sequence[np.ndarray] | None = None,
                     token_fields: Mapping[str, Sequence[np.ndarray] | None] = {},
                     images: Sequence[Sequence] | None = None,
                     vision_cfg: VisionConfig | None = None):
  """A TrainBatch (numpy) of prompt + completion trajectories.

  The inputs are trajectory[:-1] and the targets trajectory[1:]; the loss mask covers the
  completion's targets (all zero when train_mask is False; a train_mask entry may also be a
  bool[n] per completion token). token_weights (f32[n] per completion, e.g. importance
  weights) multiply the advantage of each completion token. token_fields name further
  TrainBatch fields given per completion token, [n, ...] per completion, zero on the prompt
  (teacher_logp: a teacher's log-probs, teacher_topk_ids and teacher_topk_logp: its top k,
  turn_rewards: an episode's per-turn rewards), or per input token of the whole trajectory,
  [len(prompt) + n - 1, ...] (routed_experts); each is aligned with the trajectory's end. A
  None entry is left out. `images` (with the vision-language model's `vision_cfg`): each
  prompt's raw images, in the order of its image tokens: the batch then carries each row's
  images and multimodal positions (`with_images`).
  Returns (batch, placements).
  """
  fields = {name: values for name, values in token_fields.items() if values is not None}
  sequences = []
  weights = token_weights if token_weights is not None else [1.0] * len(prompts)
  for i, (prompt, completion, logp, adv, keep, weight) in enumerate(zip(
      prompts, completions, completion_logp, advantages, train_mask, weights)):
    full = np.concatenate([np.asarray(prompt, np.int32), np.asarray(completion, np.int32)])
    n, p = len(full) - 1, len(prompt)
    mask = np.zeros((n,), np.float32)
    mask[p - 1:] = np.asarray(keep, np.float32)
    old_logp = np.zeros((n,), np.float32)
    old_logp[p - 1:] = logp
    token_adv = np.full((n,), adv, np.float32)
    token_adv[p - 1:] *= np.asarray(weight, np.float32)
    sequence = {"tokens": full[:-1], "targets": full[1:], "loss_mask": mask,
                "old_logp": old_logp, "advantages": token_adv}
    for name, values in fields.items():
      value = np.asarray(values[i])
      if len(value) not in (n - p + 1, n):
        raise ValueError(f"trajectory_batch: {name} of trajectory {i} has {len(value)} entries; "
                         f"its completion has {n - p + 1} tokens and its inputs {n}")
      sequence[name] = np.zeros((n,) + value.shape[1:], value.dtype)
      sequence[name][n - len(value):] = value
    sequences.append(sequence)
  if images is not None and any(images):
    return with_images(sequences, prompts, images, vision_cfg, seq_len, row_multiple)
  packed, placements = pack(sequences, seq_len, row_multiple=row_multiple)
  return TrainBatch(**packed), placements


def with_images(sequences: list[dict[str, np.ndarray]], prompts: Sequence[Sequence[int]],
                images: Sequence[Sequence], vision_cfg: VisionConfig, seq_len: int,
                row_multiple: int):
  """`pack` of sequences whose prompts have `images` (raw, per prompt): positions
  i32[rows, seq, 3] each sequence's multimodal ones, and each row's images, preprocessed,
  with the places of their prompts' placeholders in the row. -> (TrainBatch, placements)"""
  if vision_cfg is None:
    raise ValueError("trajectory_batch: prompts with images need the model's VisionConfig")
  patched = vision.preprocess_each(images, vision_cfg)
  for sequence, prompt, ims in zip(sequences, prompts, patched):
    sequence["mrope"] = vision.sequence_positions(
        prompt, len(sequence["tokens"]) - len(prompt) + 1, [im.grid for im in ims],
        vision_cfg)[:len(sequence["tokens"])]
  packed, placements = pack(sequences, seq_len, row_multiple=row_multiple)
  rows: list[tuple[list, list]] = [([], []) for _ in range(packed["tokens"].shape[0])]
  for i in sorted(range(len(sequences)), key=lambda i: placements[i]):
    row, start = placements[i]
    rows[row][0].extend(patched[i])
    rows[row][1].extend(start + k for k in vision.placeholder_slots(prompts[i], vision_cfg))
  packed["positions"] = packed.pop("mrope")
  return TrainBatch(**packed, images=vision.row_images(rows, vision_cfg)), placements


def pair_batch(prompts: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]],
               rejected: Sequence[Sequence[int]], seq_len: int, *, row_multiple: int = 1):
  """A TrainBatch (numpy) of preference pairs for rl.losses `dpo`: pair i is prompt i +
  chosen i and prompt i + rejected i, placed next to each other in one row as segments 2k+1
  (chosen) and 2k+2 (rejected). The loss mask covers both completions' targets; old_logp and
  advantages are zero (DPO reads only ref_logp). Returns (batch, placements of the pairs)."""
  pairs = []
  for prompt, good, bad in zip(prompts, chosen, rejected):
    halves = []
    for half, completion in enumerate((good, bad)):
      full = np.concatenate([np.asarray(prompt, np.int32), np.asarray(completion, np.int32)])
      n = len(full) - 1
      mask = np.zeros((n,), np.float32)
      mask[len(prompt) - 1:] = 1.0
      halves.append({"tokens": full[:-1], "targets": full[1:], "loss_mask": mask,
                     "half": np.full((n,), half, np.int32),
                     "position": np.arange(n, dtype=np.int32)})
    pairs.append({k: np.concatenate([h[k] for h in halves]) for k in halves[0]})
  fields, placements = pack(pairs, seq_len, row_multiple=row_multiple)
  placed = fields["segment_ids"] > 0
  fields["segment_ids"] = np.where(placed, 2 * fields["segment_ids"] - 1 + fields.pop("half"),
                                   0).astype(np.int32)
  fields["positions"] = fields.pop("position")
  zeros = np.zeros_like(fields["loss_mask"])
  return TrainBatch(old_logp=zeros, advantages=zeros, **fields), placements
