"""The RL loop: a Python generator of steps, and `train`, the run around it.

Owns the order of one RL step (draw prompts -> generate -> verify -> reward transforms ->
advantages -> pack -> train step -> weight sync -> prompt statistics) and, in `train`, a run
directory: SFT warm start, held-out evaluation, orbax checkpoints, metrics.jsonl, the plot,
and resuming from the last checkpoint. The generator does no I/O, so a notebook can drive
it a few steps at a time; `train` adds the I/O.
"""

import dataclasses
import json
import os
import time
from typing import Any, Callable, Iterator, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from models import sharding, transformer
from models.attention import dispatch
from models.config import ModelConfig
from models.tokenizer import CharTokenizer
from rl import ConfigError
from rl import advantages as advantages_lib
from rl import eval as eval_lib
from rl import losses
from rl import metrics as metrics_lib
from rl import rewards as rewards_lib
from rl import sampling as sampling_lib
from rl import sft
from rl.checkpoint import Checkpointer
from rl import kl as kl_lib
from rl.packing import trajectory_batch, unpack
from rl.train_step import TrainState, init_train_state, make_train_step, policy_logprobs
from rl.types import Rollouts
from rollouts.engine import RolloutEngine, SamplingParams
from rollouts.jax_engine import JaxEngine


@flax.struct.dataclass
class LoopState:
  """Everything a resumed run needs; saved whole by rl/checkpoint.py."""
  step: jax.Array  # i32[] RL steps (rollout batches) done; the engine's weight version
  train: TrainState  # train.step counts optimizer updates (minibatches per RL step)
  rng: jax.Array  # u32[2]
  prompt_stats: sampling_lib.PromptStats
  sampler_state: Any
  reward_state: Any


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Sizes of one RL step."""
  prompts_per_step: int = 32
  samples_per_prompt: int = 8
  max_new_tokens: int = 48
  temperature: float = 1.0
  top_p: float = 1.0
  minibatches: int = 1  # optimizer updates per RL step, each on a disjoint share of groups
  # DAPO dynamic sampling (arXiv 2503.14476): drop groups whose rewards are all equal and
  # generate more prompts until the step has prompts_per_step groups, at most
  # max_generation_rounds generations (then an error, as in verl's recipe).
  drop_uniform_groups: bool = False
  max_generation_rounds: int = 8
  # KL to the reference in the reward (PPO/InstructGPT style; verl use_kl_in_reward):
  # r_i -= kl_reward_coef * sum_t kl(engine_logp_t, ref_logp_t), kl one of rl.kl.ESTIMATORS.
  kl_reward_coef: float = 0.0
  kl_reward_estimator: str = "k1"
  seq_len: int = 128  # packed row length; must hold prompt + completion
  row_multiple: int = 8  # rows are padded to a multiple of this (fewer recompiles)
  micro_batches: int = 1


@dataclasses.dataclass
class StepRecord:
  """What one RL step yields: the new state, scalar metrics, and the step's completions."""
  step: int
  state: LoopState
  metrics: dict[str, float]
  scored: eval_lib.Scored
  rewards: np.ndarray


def init_loop_state(params, optimizer, *, num_prompts: int, sampler, reward, seed: int
                    ) -> LoopState:
  return LoopState(jnp.zeros((), jnp.int32), init_train_state(params, optimizer),
                   jax.random.PRNGKey(seed),
                   sampling_lib.PromptStats.create(num_prompts), sampler.init(num_prompts),
                   reward.init())


def rl_steps(state: LoopState, *, engine: RolloutEngine, task, tokenizer,
             train_step: Callable, advantage: str, reward: rewards_lib.RewardTransform,
             sampler: sampling_lib.SamplingTransform, config: RLConfig,
             ref_params=None, reference_logprobs: Optional[Callable] = None
             ) -> Iterator[StepRecord]:
  """Run RL steps forever from `state`, yielding a StepRecord after each.

  `ref_params` go to the train step (KL in the loss); `reference_logprobs` (a TrainBatch ->
  log-probs function under the reference) serves `config.kl_reward_coef` (KL in the reward).
  `train_step` comes from rl.train_step.make_train_step; `advantage` names an estimator in
  rl.advantages. Each step makes `config.minibatches` optimizer updates, each on a share of
  whole groups; after the step the engine gets the new weights (version = RL step).
  """
  groups, group_size = config.prompts_per_step, config.samples_per_prompt
  sampling = SamplingParams(max_new_tokens=config.max_new_tokens,
                            temperature=config.temperature, top_p=config.top_p,
                            stop_token_ids=(tokenizer.eos_id,))
  advantage_fn = advantages_lib.ESTIMATORS[advantage]
  if config.kl_reward_coef and reference_logprobs is None:
    raise ValueError("RLConfig.kl_reward_coef > 0 needs reference_logprobs (TrainBatch -> "
                     "f32[rows, seq] log-probs under the reference policy)")
  while True:
    step = int(state.step)
    rng, stats = state.rng, state.prompt_stats
    sampler_state, reward_state = state.sampler_state, state.reward_state
    kept: list[tuple[eval_lib.Scored, Rollouts]] = []  # one entry per generation round
    started = time.perf_counter()
    for _ in range(config.max_generation_rounds if config.drop_uniform_groups else 1):
      rng, draw_key, gen_key = jax.random.split(rng, 3)
      weights, sampler_state = sampler.update(stats, sampler_state, step=step)
      indices = np.asarray(sampling_lib.draw(draw_key, weights, groups))
      scored = eval_lib.generate_and_verify(
          engine, task, tokenizer, [task.train[int(i)] for i in indices], sampling,
          samples=group_size, seed=int(jax.random.randint(gen_key, (), 0, 2**31 - 1)))
      rollouts, reward_state = reward.update(_rollouts(scored, groups), reward_state, step=step)
      if config.kl_reward_coef:
        rollouts = rollouts.replace(reward=rollouts.reward - config.kl_reward_coef * _sequence_kl(
            scored, reference_logprobs, config))
      successes = scored.correct.reshape(groups, group_size).sum(axis=1)
      stats = stats.record(jnp.asarray(indices), group_size, jnp.asarray(successes), step=step)
      keep = np.ones(groups, bool)
      if config.drop_uniform_groups:
        keep = np.asarray(rollouts.reward).reshape(groups, group_size).std(axis=1) > 0
      kept.append(_select_groups(scored, rollouts, np.flatnonzero(keep), group_size))
      if sum(r.num_groups for _, r in kept) >= groups:
        break
    else:  # only dynamic sampling can come short
      raise RuntimeError(
          f"dynamic sampling: fewer than {groups} groups with unequal rewards after "
          f"{config.max_generation_rounds} generation rounds at step {step}; raise "
          "RLConfig.max_generation_rounds or make the prompts less uniform")
    scored, rollouts = _concat_groups(kept, groups, group_size)
    generate_s = time.perf_counter() - started
    group_ids = np.asarray(rollouts.group_ids)
    adv = np.asarray(advantage_fn(rollouts.reward, rollouts.group_ids, groups))
    loss_mask = np.asarray(rollouts.loss_mask)

    started = time.perf_counter()
    train, per_update, rows = state.train, [], 0
    for share_groups in np.array_split(np.arange(groups), config.minibatches):
      share = np.flatnonzero(np.isin(group_ids, share_groups))
      batch, _ = trajectory_batch(
          [scored.prompt_ids[i] for i in share],
          [scored.completions[i].token_ids for i in share],
          [scored.completions[i].logprobs for i in share], adv[share], loss_mask[share],
          config.seq_len, row_multiple=config.row_multiple * config.micro_batches)
      train, update_metrics = train_step(train, batch, ref_params)
      per_update.append(update_metrics)
      rows += batch.tokens.shape[0]
    per_update = jax.device_get(per_update)
    train_metrics = {k: float(np.mean([m[k] for m in per_update])) for k in per_update[0]}
    train_metrics["logp_diff_max"] = float(max(m["logp_diff_max"] for m in per_update))
    train_s = time.perf_counter() - started
    engine.update_weights(train.params, version=step + 1)

    state = LoopState(jnp.int32(step + 1), train, rng, stats, sampler_state, reward_state)
    rewards = np.asarray(rollouts.reward)
    metrics = {"step": step + 1, "reward": float(rewards.mean()),
               "accuracy": float(scored.correct.mean()),
               "completion_length": float(scored.lengths.mean()),
               "truncated": float(scored.truncated.mean()), "rows": rows,
               "generation_rounds": len(kept),
               "generate_s": generate_s, "train_s": train_s, **train_metrics}
    yield StepRecord(step + 1, state, metrics, scored, rewards)


def _sequence_kl(scored: eval_lib.Scored, reference_logprobs: Callable, config: RLConfig):
  """sum_t kl(engine_logp_t, ref_logp_t) over each completion's tokens: f32[N]. The engine's
  log-probs stand for the behaviour policy (they equal the trainer's, see logp_diff_*)."""
  lengths = [len(p) + len(c.token_ids) - 1 for p, c in zip(scored.prompt_ids,
                                                           scored.completions)]
  batch, placements = trajectory_batch(
      scored.prompt_ids, [c.token_ids for c in scored.completions],
      [c.logprobs for c in scored.completions], [0.0] * len(lengths), [True] * len(lengths),
      config.seq_len, row_multiple=config.row_multiple)
  ref_logp = np.asarray(reference_logprobs(jax.tree.map(jnp.asarray, batch)))
  kl = np.asarray(kl_lib.ESTIMATORS[config.kl_reward_estimator](
      jnp.asarray(batch.old_logp), jnp.asarray(ref_logp))) * batch.loss_mask
  return jnp.asarray([x.sum() for x in unpack(kl, placements, lengths)], jnp.float32)


def _rollouts(scored: eval_lib.Scored, groups: int) -> Rollouts:
  n = len(scored.texts)
  return Rollouts(group_ids=jnp.asarray(np.repeat(np.arange(groups), n // groups)),
                  correct=jnp.asarray(scored.correct), lengths=jnp.asarray(scored.lengths),
                  truncated=jnp.asarray(scored.truncated),
                  well_formed=jnp.asarray(scored.well_formed),
                  reward=jnp.zeros(n, jnp.float32), loss_mask=jnp.ones(n, bool),
                  num_groups=groups)


def _select_groups(scored: eval_lib.Scored, rollouts: Rollouts, keep, group_size: int):
  """The completions of groups `keep` (indices, in order), renumbered 0..len(keep)-1."""
  rows = (keep[:, None] * group_size + np.arange(group_size)).reshape(-1)
  pick = lambda xs: [xs[i] for i in rows]
  part = eval_lib.Scored(pick(scored.prompt_ids), pick(scored.completions), pick(scored.texts),
                         scored.correct[rows], scored.lengths[rows], scored.truncated[rows],
                         scored.well_formed[rows])
  arrays = jax.tree.map(lambda x: np.asarray(x)[rows], rollouts)
  return part, arrays.replace(group_ids=np.repeat(np.arange(len(keep)), group_size),
                              num_groups=len(keep))


def _concat_groups(parts, groups: int, group_size: int):
  """The first `groups` groups of the rounds' kept groups, as one Scored and one Rollouts."""
  n = groups * group_size
  cat_list = lambda name: [x for scored, _ in parts for x in getattr(scored, name)][:n]
  cat_array = lambda xs: np.concatenate(xs)[:n]
  scored = eval_lib.Scored(cat_list("prompt_ids"), cat_list("completions"), cat_list("texts"),
                           *(cat_array([getattr(s, f) for s, _ in parts])
                             for f in ("correct", "lengths", "truncated", "well_formed")))
  # num_groups is static pytree metadata: make it equal before mapping over the parts.
  rollouts = jax.tree.map(lambda *xs: jnp.asarray(cat_array(xs)),
                          *[r.replace(num_groups=groups) for _, r in parts])
  return scored, rollouts.replace(group_ids=jnp.asarray(np.repeat(np.arange(groups),
                                                                   group_size)),
                                  num_groups=groups)


def rl_optimizer(learning_rate: float, *, max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(learning_rate, weight_decay=weight_decay))


def train(run_dir: str, *, task, model: Callable[[int], ModelConfig],
          tokenizer: Optional[CharTokenizer] = None, loss: str = "k1.5",
          loss_hparams: Optional[dict[str, Any]] = None, advantage: Optional[str] = None,
          reward: Optional[rewards_lib.RewardTransform] = None,
          sampler: Optional[sampling_lib.SamplingTransform] = None,
          rl: RLConfig = RLConfig(), num_steps: int = 100, learning_rate: float = 1e-4,
          sft_steps: int = 200, sft_batch_size: int = 64,
          sft_learning_rate: float = 3e-3, eval_records: int = 256, eval_every: int = 0,
          checkpoint_every: int = 20, seed: int = 0, progress: bool = True,
          mesh: Optional[Mesh] = None,
          sampled_eval: Optional[eval_lib.SampledEval] = None) -> dict[str, Any]:
  """A whole run in `run_dir`: SFT warm start, held-out eval, `num_steps` RL steps, eval.

  `model` is called with the tokenizer's vocabulary size (e.g. models.config.tiny).
  `advantage` overrides the estimator the loss is registered with. If
  `run_dir` holds a checkpoint the run resumes from it: no SFT again, the step count goes on,
  metrics.jsonl is appended. The SFT params are saved in `run_dir/sft`; they are the
  reference policy of losses with a KL term. Returns {"sft_accuracy", "rl_accuracy",
  "steps", ...}.
  `mesh` (models.sharding.make_mesh) is where the SFT and RL train steps and the reference
  log-probs run; its `context` axis turns on ring attention. The embedded engine runs on one
  device.
  `sampled_eval` adds pass@k / maj@k / mean@k at its largest budget on the same
  `eval_records` to every `eval_every` evaluation (logged as eval_pass@k, ...).
  """
  tokenizer = tokenizer or CharTokenizer()
  reward = reward or rewards_lib.named_chain({"correctness": rewards_lib.correctness()})
  sampler = sampler or sampling_lib.uniform()
  # Everything that can be wrong with the configuration fails here, before any compile.
  loss_fn = losses.bind(loss, loss_hparams)
  advantage = advantage or losses.get(loss).advantage
  if advantage not in advantages_lib.ESTIMATORS:
    raise ConfigError(f"unknown advantage estimator {advantage!r}; valid: "
                      f"{', '.join(sorted(advantages_lib.ESTIMATORS))}")
  cfg = model(tokenizer.vocab_size)
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                     f"{tokenizer.vocab_size}")
  context = 1 if mesh is None else mesh.shape["context"]
  try:
    kernel = dispatch.plan(cfg.attention, context)
  except dispatch.KernelUnavailable as e:
    raise ConfigError(str(e)) from None
  if kernel == "ring":
    kernel = f"ring over {context} sequence shards"
  if rl.kl_reward_estimator not in kl_lib.ESTIMATORS:
    raise ConfigError(f"unknown RLConfig.kl_reward_estimator {rl.kl_reward_estimator!r}; "
                      f"valid: {sorted(kl_lib.ESTIMATORS)}")
  if not 1 <= rl.minibatches <= rl.prompts_per_step:
    raise ConfigError(f"RLConfig.minibatches={rl.minibatches} must be in [1, prompts_per_step="
                      f"{rl.prompts_per_step}]")
  if rl.prompts_per_step > len(task.train):
    raise ConfigError(f"RLConfig.prompts_per_step={rl.prompts_per_step} exceeds the "
                     f"{len(task.train)} training prompts")
  if eval_records > len(task.test):
    raise ConfigError(f"eval_records={eval_records} exceeds the {len(task.test)} test records")

  mesh_shape = "one device" if mesh is None else dict(mesh.shape)
  print(f"train step: mesh {mesh_shape}, attention {kernel}")
  os.makedirs(run_dir, exist_ok=True)
  metrics_path = os.path.join(run_dir, "metrics.jsonl")
  summary_path = os.path.join(run_dir, "summary.json")
  checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
  sft_checkpointer = Checkpointer(os.path.join(run_dir, "sft"), max_to_keep=1)
  optimizer = rl_optimizer(learning_rate)
  evaluate = lambda engine: eval_lib.greedy_accuracy(
      engine, task, tokenizer, num_records=eval_records, max_new_tokens=rl.max_new_tokens)

  params = transformer.init_params(cfg, jax.random.PRNGKey(seed))
  state = init_loop_state(params, optimizer, num_prompts=len(task.train), sampler=sampler,
                          reward=reward, seed=seed + 1)
  summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
  if checkpointer.latest_step() is not None:
    state = checkpointer.restore(state)
    print(f"resuming from {run_dir} at RL step {int(state.step)}")
    moved = metrics_lib.truncate(metrics_path, int(state.step))
    if moved:
      print(f"{moved} metrics records after the checkpoint moved to {metrics_path}.discarded")
  else:
    started = time.perf_counter()
    with sharding.use(mesh):
      params, sft_loss = sft.warm_start(params, cfg, task, tokenizer, steps=sft_steps,
                                        batch_size=sft_batch_size,
                                        learning_rate=sft_learning_rate, seq_len=rl.seq_len,
                                        seed=seed, progress=progress)
    state = state.replace(train=init_train_state(params, optimizer))
    sft_checkpointer.save(0, params)
    sft_accuracy, sft_length = evaluate(JaxEngine(cfg, params))
    summary = {"sft_accuracy": sft_accuracy, "sft_length": sft_length, "sft_loss": sft_loss,
               "sft_seconds": time.perf_counter() - started}
    _write_json(summary_path, summary)
    metrics_lib.append(metrics_path, {"step": 0, "eval_accuracy": sft_accuracy,
                                      "eval_length": sft_length})
    checkpointer.save(0, state)
    print(f"after SFT: held-out accuracy {sft_accuracy:.3f}, mean length {sft_length:.1f}")

  ref_params = reference_logprobs = None
  if losses.uses_reference(loss, loss_hparams) or rl.kl_reward_coef:
    reference = sft_checkpointer.restore(state.train.params)
    ref_params = reference if losses.uses_reference(loss, loss_hparams) else None
    # Params go in as an argument: closing over them would bake them into the executable.
    logprobs_fn = sharding.on_mesh(mesh, jax.jit(policy_logprobs, static_argnums=1))
    reference_logprobs = lambda batch: logprobs_fn(reference, cfg, batch)[0]
  sft_checkpointer.close()
  state_shardings = None
  if mesh is not None:  # params and optimizer moments split over fsdp and tensor
    sharding.check_sharded(state.train.params, mesh)
    state_shardings = sharding.state_shardings(state.train, optimizer, mesh)
    state = state.replace(train=jax.device_put(state.train, state_shardings))
  engine = JaxEngine(cfg, state.train.params, version=int(state.step))
  train_step = sharding.on_mesh(
      mesh, make_train_step(cfg, optimizer, loss_fn, micro_batches=rl.micro_batches,
                            state_shardings=state_shardings))
  steps = rl_steps(state, engine=engine, task=task, tokenizer=tokenizer, train_step=train_step,
                   advantage=advantage, reward=reward, sampler=sampler,
                   config=rl, ref_params=ref_params, reference_logprobs=reference_logprobs)
  start_step = int(state.step)
  bar = tqdm(total=num_steps, initial=start_step, desc=f"RL ({loss})", disable=not progress,
             dynamic_ncols=True)
  for _ in range(max(0, num_steps - start_step)):
    record = next(steps)
    state, m = record.state, record.metrics
    if eval_every and record.step % eval_every == 0:
      m["eval_accuracy"], m["eval_length"] = evaluate(engine)
      if sampled_eval is not None:
        held_out = [task.test[i] for i in range(eval_records)]
        report = eval_lib.sampled_eval(engine, task, tokenizer, held_out, sampled_eval,
                                       seed=seed + record.step)
        m.update({f"eval_{key}": value
                  for key, value in report["budgets"][max(report["budgets"])].items()})
    metrics_lib.append(metrics_path, m)
    bar.set_postfix(reward=f"{m['reward']:.2f}", acc=f"{m['accuracy']:.2f}",
                    len=f"{m['completion_length']:.1f}")
    bar.update(1)
    if record.step % checkpoint_every == 0 or record.step == num_steps:
      checkpointer.save(record.step, state)
  bar.close()
  checkpointer.close()

  rl_accuracy, rl_length = evaluate(engine)
  summary.update(rl_accuracy=rl_accuracy, rl_length=rl_length, steps=int(state.step))
  _write_json(summary_path, summary)
  metrics_lib.plot(metrics_lib.read(metrics_path), os.path.join(run_dir, "metrics.png"),
                   title=f"{loss} on {type(task).__name__}")
  print(f"held-out accuracy after RL: {rl_accuracy:.3f}, mean length {rl_length:.1f}")
  print(f"sft_accuracy={summary.get('sft_accuracy', float('nan')):.2f} "
        f"rl_accuracy={rl_accuracy:.2f}")
  return summary


def _write_json(path: str, value: dict) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=2)
