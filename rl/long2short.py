"""long2short (Kimi k1.5 sec. 2.4): make a long chain-of-thought policy answer in fewer tokens.

Owns shortest rejection sampling, k1.5's DPO pairing rule and the DPO fine-tuning loop (the
loss itself is rl.losses `dpo`), weight merging, and `run`, which applies one of them to a
trained run and evaluates the result. Long2short RL is an ordinary RL run started from the
long model with a length penalty and a lower max_new_tokens (`train(start=FromRun(...))`,
experiments/configs/long2short_rl.gin).

Every method starts from the same samples: n completions per training prompt from the long
model (`sample`), verified trajectories (rl.trajectory.Trajectory), prompt-major, n per
prompt.
"""

import dataclasses
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from models import transformer
from models.config import ModelConfig
from models.tokenizer import CharTokenizer, stop_ids
from rl import checkpoint, eval as eval_lib, losses, rollout, sft
from rl.packing import pair_batch
from rl.train_step import init_train_state, make_train_step
from rl.trajectory import Trajectory, column
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

METHODS = ("shortest_rejection", "dpo", "merge")


# ----------------------------------------------------------------------------- selection rules

def shortest_correct(lengths: Sequence[int], correct: Sequence[bool]) -> int | None:
  """Index of the shortest correct completion of one group (the first among equals), or None
  when none is correct."""
  candidates = [i for i in range(len(lengths)) if correct[i]]
  return min(candidates, key=lambda i: lengths[i]) if candidates else None


def dpo_pairs(lengths: Sequence[int], correct: Sequence[bool], *, ratio: float = 1.5
              ) -> list[tuple[int, int]]:
  """k1.5's preference pairs within one group, as (chosen, rejected) indices.

  The chosen one is the shortest correct completion; rejected are the incorrect completions
  longer than it and the correct ones at least `ratio` times as long ("wrong longer responses
  and correct longer responses (1.5 times longer than the chosen positive)"; the paper does
  not say >= or >, we take >=). Incorrect completions shorter than (or as long as) the chosen
  one are not negatives. No correct completion: no pairs.
  """
  best = shortest_correct(lengths, correct)
  if best is None:
    return []
  shortest = lengths[best]
  return [(best, i) for i in range(len(lengths)) if i != best and (
      (not correct[i] and lengths[i] > shortest)
      or (correct[i] and lengths[i] >= ratio * shortest))]


# ----------------------------------------------------------------------------- samples

def sample(engine, task, tokenizer, records: Sequence[dict], *, samples: int = 8,
           max_new_tokens: int, temperature: float = 1.0, seed: int = 0
           ) -> list[Trajectory]:
  """`samples` verified completions per record from `engine` (the long model)."""
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=stop_ids(tokenizer))
  return rollout.generate(engine, task, tokenizer, records, sampling, samples=samples,
                          seed=seed)


def _groups(trajectories: Sequence[Trajectory], samples: int):
  if len(trajectories) % samples:
    raise ValueError(f"{len(trajectories)} completions do not form groups of {samples}")
  lengths = column(trajectories, "policy_count", np.int32)
  correct = column(trajectories, "correct", bool)
  for start in range(0, len(trajectories), samples):
    yield start, lengths[start:start + samples], correct[start:start + samples]


def shortest_rejection_examples(trajectories: Sequence[Trajectory], samples: int
                                ) -> list[sft.Example]:
  """Shortest rejection sampling: per prompt, (prompt ids, its shortest correct completion's
  ids, <eos> included); prompts with no correct completion give nothing."""
  examples = []
  for start, lengths, correct in _groups(trajectories, samples):
    best = shortest_correct(lengths, correct)
    if best is not None:
      t = trajectories[start + best]
      examples.append((list(t.prompt_ids), np.array(t.token_ids, np.int32)))
  return examples


def preference_pairs(trajectories: Sequence[Trajectory], samples: int, *, ratio: float = 1.5):
  """Every k1.5 pair of every group: (prompts, chosen, rejected) lists of token ids."""
  prompts, chosen, rejected = [], [], []
  for start, lengths, correct in _groups(trajectories, samples):
    for good, bad in dpo_pairs(lengths, correct, ratio=ratio):
      prompts.append(list(trajectories[start].prompt_ids))
      chosen.append(np.array(trajectories[start + good].token_ids, np.int32))
      rejected.append(np.array(trajectories[start + bad].token_ids, np.int32))
  return prompts, chosen, rejected


# ----------------------------------------------------------------------------- methods

def shortest_rejection_sft(params, cfg: ModelConfig, examples: Sequence[sft.Example], *,
                           steps: int, batch_size: int = 32, learning_rate: float = 3e-4,
                           seq_len: int = 128, seed: int = 0, progress: bool = True):
  """SFT of the long model on its own shortest correct completions. Returns params."""
  params, _ = sft.fit(params, cfg, lambda i: examples[i], len(examples), steps=steps,
                      batch_size=batch_size, learning_rate=learning_rate, seq_len=seq_len,
                      seed=seed, progress=progress, desc="long2short SFT")
  return params


def dpo(params, cfg: ModelConfig, pairs, *, steps: int, beta: float = 0.1,
        batch_size: int = 32, learning_rate: float = 1e-5, seq_len: int = 128, seed: int = 0,
        progress: bool = True):
  """DPO from `params` on `pairs` = (prompts, chosen, rejected) (see `preference_pairs`),
  the reference being `params` frozen. `seq_len` is the longest prompt + completion; a pair
  row holds both halves, 2 * seq_len. Returns (params, metrics of the last update)."""
  prompts, chosen, rejected = pairs
  if not prompts:
    raise ValueError("dpo: no preference pairs (no group had a correct completion and a "
                     "longer negative)")
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))
  # Updated in place (donated), from a copy: `params` stay the frozen reference.
  step_fn = make_train_step(cfg, optimizer, losses.bind("dpo", {"beta": beta}),
                            donate_state=True)
  reference, state = params, init_train_state(jax.tree.map(jnp.copy, params), optimizer)
  rng = np.random.default_rng(seed)
  metrics = {}
  bar = tqdm(total=steps, desc="long2short DPO", disable=not progress, dynamic_ncols=True)
  for _ in range(steps):
    pick = rng.integers(0, len(prompts), batch_size)
    batch, _ = pair_batch([prompts[i] for i in pick], [chosen[i] for i in pick],
                          [rejected[i] for i in pick], 2 * seq_len, row_multiple=8)
    state, metrics = step_fn(state, jax.tree.map(jnp.asarray, batch), reference)
    bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                    acc=f"{float(metrics['reward_accuracy']):.2f}")
    bar.update(1)
  bar.close()
  return state.params, {k: float(v) for k, v in jax.device_get(metrics).items()}


def merge(long_params, short_params, ratio: float = 0.5):
  """Weight merging: (1 - ratio) * long + ratio * short, leaf by leaf, in float32 and back
  to each leaf's dtype. ratio 0 returns the long model and 1 the short one exactly."""
  if not 0.0 <= ratio <= 1.0:
    raise ValueError(f"merge: ratio must be in [0, 1], got {ratio}")
  if jax.tree.structure(long_params) != jax.tree.structure(short_params):
    raise ValueError("merge: the two models have different parameter trees")

  def mix(a, b):
    if a.shape != b.shape:
      raise ValueError(f"merge: shapes differ ({a.shape} vs {b.shape})")
    if ratio in (0.0, 1.0):
      return jnp.asarray(b if ratio else a)
    return ((1.0 - ratio) * jnp.asarray(a, jnp.float32)
            + ratio * jnp.asarray(b, jnp.float32)).astype(a.dtype)

  return jax.tree.map(mix, long_params, short_params)


# ----------------------------------------------------------------------------- a whole run

def load(run_dir: str, cfg: ModelConfig):
  """The latest params of `run_dir` (an RL run or a saved policy), checked against `cfg`."""
  like = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  return checkpoint.load_policy(run_dir, like=like)


def evaluate(params, cfg: ModelConfig, task, tokenizer, *, num_records: int,
             max_new_tokens: int, samples: int = 4, seed: int = 0) -> dict:
  """Held-out accuracy and mean completion length, greedy and sampled (`samples` per prompt
  at temperature 1). Greedy length shows only the most likely length; the sampled mean is
  the length the policy spends on average (the one long2short is about)."""
  engine = JaxEngine(cfg, params)
  greedy = eval_lib.greedy_eval(engine, task, tokenizer, num_records=num_records,
                                max_new_tokens=max_new_tokens)
  sampled = sample(engine, task, tokenizer, [task.test[i] for i in range(num_records)],
                   samples=samples, max_new_tokens=max_new_tokens, seed=seed)
  return {"accuracy": greedy["accuracy"], "length": greedy["length"],
          "sampled_accuracy": float(column(sampled, "correct", bool).mean()),
          "sampled_length": float(column(sampled, "policy_count", np.int32).mean())}


@dataclasses.dataclass(frozen=True)
class Long2ShortConfig:
  """The sizes of a long2short `run`: `samples` completions (at most max_new_tokens, at
  `temperature`) for each of the first `num_prompts` training prompts; `steps` updates of
  `batch_size` (SFT or DPO; learning_rate None: the method's own) on rows of seq_len; DPO's
  `beta` and k1.5's `pair_ratio`; merging's `merge_ratio`; `eval_records` held-out records
  for the evaluation before and after."""
  num_prompts: int = 512
  samples: int = 8
  max_new_tokens: int = 72
  temperature: float = 1.0
  steps: int = 100
  batch_size: int = 32
  learning_rate: float | None = None
  beta: float = 0.1
  pair_ratio: float = 1.5
  merge_ratio: float = 0.5
  eval_records: int = 256
  seq_len: int = 128


def run(out_dir: str, *, long_run: str, model: Callable[[int], ModelConfig], task,
        method: str, sizes: Long2ShortConfig = Long2ShortConfig(),
        merge_with: str | None = None, seed: int = 0, progress: bool = True) -> dict:
  """Apply `method` to the latest params of `long_run` and save the result in `out_dir` (an
  rl.checkpoint.save_policy directory, usable as a FromRun start or by evaluate), with
  summary.json: `evaluate` of the long model (long_*) and of the new one.

  shortest_rejection: `samples` completions for each of the first `num_prompts` training
    prompts, SFT (`steps`) on the shortest correct one per prompt.
  dpo: the same samples, DPO (`steps`, `beta`) on k1.5's pairs (`pair_ratio`). Its default
    learning rate is 1e-5: at 1e-4 the tiny findings model lost both chosen and rejected
    likelihood (the known DPO failure) and its accuracy with them.
  merge: weight average of long_run and `merge_with` (a run dir, e.g. a shortest_rejection
    output), `merge_ratio` of the latter.
  `model` is the config factory both runs used (e.g. models.config.tiny).
  """
  if method not in METHODS:
    raise ValueError(f"long2short method {method!r}; valid: {', '.join(METHODS)}")
  if method == "merge" and not merge_with:
    raise ValueError("long2short method 'merge' needs merge_with, the short model's run dir")
  tokenizer = CharTokenizer()
  cfg = model(tokenizer.vocab_size)
  long_params = load(long_run, cfg)
  summary = {"method": method, "long_run": long_run}
  if method == "merge":
    params = merge(long_params, load(merge_with, cfg), sizes.merge_ratio)
    summary.update(merge_with=merge_with, merge_ratio=sizes.merge_ratio)
  else:
    params = _trained(method, long_params, cfg, task, tokenizer, sizes, seed, progress, summary)
  checkpoint.save_policy(out_dir, params)
  measure = lambda p: evaluate(p, cfg, task, tokenizer, num_records=sizes.eval_records,
                               max_new_tokens=sizes.max_new_tokens, seed=seed)
  summary.update({f"long_{k}": v for k, v in measure(long_params).items()})
  summary.update(measure(params))
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"{method}: sampled accuracy {summary['long_sampled_accuracy']:.3f} -> "
        f"{summary['sampled_accuracy']:.3f}, mean length {summary['long_sampled_length']:.1f} "
        f"-> {summary['sampled_length']:.1f} (greedy: {summary['long_accuracy']:.3f} -> "
        f"{summary['accuracy']:.3f}, {summary['long_length']:.1f} -> {summary['length']:.1f})")
  return summary


def _trained(method: str, long_params, cfg: ModelConfig, task, tokenizer,
             sizes: Long2ShortConfig, seed: int, progress: bool, summary: dict):
  """shortest_rejection or dpo on the long model's samples; the samples' statistics and the
  method's go into `summary`. Returns the new params."""
  records = [task.train[i] for i in range(sizes.num_prompts)]
  sampled = sample(JaxEngine(cfg, long_params), task, tokenizer, records, samples=sizes.samples,
                   max_new_tokens=sizes.max_new_tokens, temperature=sizes.temperature,
                   seed=seed)
  correct = column(sampled, "correct", bool)
  lengths = column(sampled, "policy_count", np.int32)
  summary.update(sample_accuracy=float(correct.mean()), sample_length=float(lengths.mean()),
                 sample_correct_length=float(lengths[correct].mean())
                 if correct.any() else float("nan"))
  rate = {"learning_rate": sizes.learning_rate} if sizes.learning_rate else {}
  common = dict(steps=sizes.steps, batch_size=sizes.batch_size, seq_len=sizes.seq_len,
                seed=seed, progress=progress, **rate)
  if method == "shortest_rejection":
    examples = shortest_rejection_examples(sampled, sizes.samples)
    summary["examples"] = len(examples)
    summary["example_length"] = float(np.mean([len(t) for _, t in examples]))
    return shortest_rejection_sft(long_params, cfg, examples, **common)
  pairs = preference_pairs(sampled, sizes.samples, ratio=sizes.pair_ratio)
  summary["pairs"] = len(pairs[0])
  params, last = dpo(long_params, cfg, pairs, beta=sizes.beta, **common)
  summary.update({f"dpo_{k}": v for k, v in last.items()})
  return params
