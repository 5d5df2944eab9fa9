"""A run: its parts built from a configuration, the loop's generator, and the hooks around it.

`build` makes everything a run needs and checks the configuration before anything is compiled
or written: the model config and its starting params (random init and an SFT warm start, or
another run's params), resumed from the run directory's last checkpoint when there is one;
the rollout engine (and the evaluation engine), the teachers, the reference policy, the
jitted train step on the mesh, the rollout source, the checkpointer and the loggers. It
returns a `Run` (rl/run.py), whose `steps()` is the generator of rl/loop.py over those
parts: a notebook drives it directly. `train` is `build`, then the generator drained through
the hooks of rl/hooks.py (evaluation, monitors, metrics.jsonl and loggers, the progress bar,
checkpoints, the summary), then the run closed.

A reproducible run (`RLConfig.deterministic`, `make_deterministic`) is one the same command repeats
bit for bit on the same hardware and software.

Owns the run-level configuration (Objective, the `Start` protocol and its WarmStart and
FromRun, Hooks, Evaluation) and the run directory's layout: config.gin (written by
experiments/run.py), metrics.jsonl, samples.jsonl (rl/samples.py), metrics.png, summary.json,
checkpoints/, sft/ (the starting params: the reference policy), TensorBoard and W&B files.
"""

import contextlib
import dataclasses
import importlib.util
import json
import os
import time
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from models import distributed, sharding, transformer, vision
from models import lora as lora_lib
from models.attention import dispatch
from models.config import ModelConfig
from models.tokenizer import CharTokenizer, ChatPrompts, WithImages
from rl import ConfigError
from rl import advantages as advantages_lib
from rl import checkpoint
from rl import corrections as corrections_lib
from rl import distill
from rl import eval as eval_lib
from rl import hooks as hooks_lib
from rl import loggers as loggers_lib
from rl import loop
from rl import losses
from rl import metrics as metrics_lib
from rl import monitors as monitors_lib
from rl import rewards as rewards_lib
from rl import rollout
from rl import run_lock
from rl.run import Run
from rl import samples as samples_lib
from rl import sampling as sampling_lib
from rl import sft
from rl import sources
from rl.checkpoint import Checkpointer
from rl.config import KLReward, RLConfig
from rl.pretrained import HFCheckpoint
from rl.train_step import init_train_state, make_train_step, policy_logprobs
from rollouts.engine import RolloutEngine
from rollouts.jax_engine import embedded_engine
from rollouts.sglang import DETERMINISTIC_ENV

# (cfg, params, version) -> a RolloutEngine holding `params` as `version`.
EngineFactory = Callable[[ModelConfig, Any, int], RolloutEngine]


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a step optimizes: the loss (a registered name, with `loss_hparams` and an
  `advantage` estimator overriding the one it is registered with), the reward transform
  (default: correctness), the prompt sampler (default: uniform), the KL to the reference in
  the reward, the off-policy correction of each minibatch (rl/corrections.py; default keep),
  for distillation `teachers(cfg)` scoring every trajectory (e.g.
  rl.distill.from_checkpoints), and for a mixture of experts `routing_replay`: the trainer
  routes each token to the experts the engine chose (rollout routing replay, R3; the
  trainer's log-probs for the mismatch and the corrections too, not the reference's), and
  `expert_bias_rate`: with DeepSeek-V3's correction bias, loss-free balancing moves it by
  this much after every update (models.mixture.balance_experts; 0.001 in DeepSeek-V3), and
  `expert_balance_coef`: the load-balancing loss (models.mixture.balance_loss) times it joins
  the loss (router_aux_loss_coef: 0.001 in Qwen3-MoE)."""
  loss: str = "k1.5"
  loss_hparams: Optional[Mapping[str, Any]] = None
  advantage: Optional[str] = None
  reward: Optional[rewards_lib.RewardTransform] = None
  sampler: Optional[sampling_lib.SamplingTransform] = None
  kl_reward: Optional[KLReward] = None
  correction: Optional[corrections_lib.Correction] = None
  teachers: Optional[Callable[[ModelConfig], distill.Teachers]] = None
  routing_replay: bool = False
  expert_bias_rate: float = 0.0
  expert_balance_coef: float = 0.0


class Start(Protocol):
  """Where a run's params begin, and its reference policy (the params a KL or a reference
  log-prob reads): WarmStart, FromRun, rl.pretrained.HFCheckpoint, or a class of your own
  with these methods, bound as `train.start`."""

  def check(self, tokenizer, processes: int) -> None:
    """ConfigError for what is wrong with it, or what it cannot do with `tokenizer` on
    `processes` JAX processes, before anything is built."""

  def initial(self, cfg: ModelConfig, mesh: Optional[Mesh], seed: int) -> Any:
    """The params `params` starts from (on a mesh, this process's shards)."""

  def params(self, initial, cfg: ModelConfig, task, tokenizer, *, seq_len: int, seed: int,
             progress: bool, mesh: Optional[Mesh]) -> tuple[Any, dict[str, Any]]:
    """The starting params from `initial`, and the summary's {"sft_loss", "init_from"} (a
    path when the params come from elsewhere, else None)."""

  def keep(self, run_dir: str, params) -> None:
    """Keep the starting params as the reference policy (a fresh run, once)."""

  def reference(self, run_dir: str, like) -> Any:
    """The reference policy's params, shaped and placed like `like`."""


class _StartKeptInRun:
  """A start from random params (replaced by the start's own), kept in run_dir/sft as the
  reference policy."""

  def initial(self, cfg: ModelConfig, mesh, seed: int):
    return random_params(cfg, mesh, seed)

  def keep(self, run_dir: str, params) -> None:
    saved = Checkpointer(os.path.join(run_dir, "sft"), max_to_keep=1)
    saved.save(0, params)
    saved.close()

  def reference(self, run_dir: str, like):
    saved = Checkpointer(os.path.join(run_dir, "sft"), max_to_keep=1)
    params = saved.restore(like)
    saved.close()
    return params


@dataclasses.dataclass(frozen=True)
class WarmStart(_StartKeptInRun):
  """Random init (a pretrained model's params: an HFCheckpoint), then `steps` SFT updates on
  the task's reference solutions, or with `demonstrations` on a JSONL file of chat
  demonstrations ({"messages": [...]} a line; loss on the assistant's tokens only; needs a
  chat template), so RL starts from non-zero reward; the result is the reference policy of a
  KL."""
  steps: int = 200
  batch_size: int = 64
  learning_rate: float = 3e-3
  demonstrations: str = ""

  def check(self, tokenizer, processes: int) -> None:
    del processes
    if self.steps < 0 or self.batch_size < 1:
      raise ConfigError(f"WarmStart(steps={self.steps}, batch_size={self.batch_size}): steps "
                        "must be >= 0 and batch_size >= 1")
    if self.demonstrations and not os.path.isfile(self.demonstrations):
      raise ConfigError(f"WarmStart.demonstrations={self.demonstrations!r}: no such file")
    if self.demonstrations and not isinstance(tokenizer, ChatPrompts):
      raise ConfigError("WarmStart.demonstrations are chat conversations: they need a model "
                        "with a chat template (train.model = @HFCheckpoint())")

  def params(self, initial, cfg: ModelConfig, task, tokenizer, *, seq_len: int, seed: int,
             progress: bool, mesh) -> tuple[Any, dict[str, Any]]:
    if self.demonstrations:
      examples = sft.read_demonstrations(self.demonstrations, tokenizer)
      params, loss = sft.fit(initial, cfg, examples.__getitem__, len(examples),
                             steps=self.steps, batch_size=self.batch_size,
                             learning_rate=self.learning_rate, seq_len=seq_len, seed=seed,
                             progress=progress, desc="SFT on demonstrations", mesh=mesh)
    else:
      params, loss = sft.warm_start(initial, cfg, task, tokenizer, steps=self.steps,
                                    batch_size=self.batch_size,
                                    learning_rate=self.learning_rate, seq_len=seq_len,
                                    seed=seed, progress=progress, mesh=mesh)
    return params, {"sft_loss": loss, "init_from": None}


@dataclasses.dataclass(frozen=True)
class FromRun(_StartKeptInRun):
  """The latest params of another run directory (an RL run, or a model saved by
  rl.checkpoint.save_policy), no SFT warm start: long2short RL, or several runs from one
  warm start. They are also this run's reference policy."""
  path: str

  def check(self, tokenizer, processes: int) -> None:
    del tokenizer
    if not os.path.isdir(os.path.join(self.path, "checkpoints")):
      raise ConfigError(f"FromRun (init_from) {self.path!r}: no checkpoints/ directory there")
    if processes > 1:
      raise ConfigError(f"train.start = @FromRun(): not supported with {processes} JAX "
                        "processes yet (several processes generate whole steps)")

  def params(self, initial, cfg: ModelConfig, task, tokenizer, **_) -> tuple[Any, dict]:
    try:
      return checkpoint.load_policy(self.path, like=initial), {"sft_loss": None,
                                                                "init_from": self.path}
    except ValueError as e:
      raise ConfigError(f"FromRun (init_from): {e}") from None


def random_params(cfg: ModelConfig, mesh: Optional[Mesh], seed: int):
  """Randomly initialised params; on a mesh each process makes only its own shards."""
  key = jax.random.PRNGKey(seed)
  if mesh is None:
    return transformer.init_params(cfg, key)
  init = lambda k: transformer.init_params(cfg, k)
  return jax.jit(init, out_shardings=sharding.param_shardings(jax.eval_shape(init, key),
                                                              mesh))(np.asarray(key))


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Held-out greedy evaluation of the first `records` test records after the start, every
  `every` RL steps (0: only at the end) and after the last; `sampled` adds pass@k / maj@k /
  mean@k at its largest budget to the periodic ones (eval_pass@k, ...). It runs on the
  rollout engine when that holds the current weights, else on one `engine` makes (default:
  an embedded one)."""
  records: int = 256
  every: int = 0
  sampled: Optional[eval_lib.SampledEval] = None
  engine: Optional[EngineFactory] = None


@dataclasses.dataclass(frozen=True)
class Hooks:
  """What a run does around its steps (rl/hooks.py): `evaluation`, checkpoints every
  `checkpoint_every` steps (and at the last), the collapse `monitors` (name ->
  rl.monitors.Monitor; None: rl.monitors.defaults(), {}: none) of which those named in
  `stop_on` end the run when they fire, TensorBoard event files and a W&B run
  (`wandb_project`; WANDB_MODE=offline: files only), `samples` trajectories of every
  evaluation and of every `samples_every`-th RL step (0: none; their prompts, completions,
  rewards and verdicts in samples.jsonl and tables in the loggers, rl/samples.py), the
  progress bar, and `extra` hooks of your own (rl.hooks.Hook)."""
  evaluation: Evaluation = Evaluation()
  checkpoint_every: int = 20
  monitors: Optional[Mapping[str, Any]] = None
  stop_on: Sequence[str] = ()
  tensorboard: bool = True
  wandb_project: Optional[str] = None
  samples: int = 4
  samples_every: int = 10
  progress: bool = True
  extra: Sequence[Any] = ()


# XLA's deterministic GPU operations: reductions and scatters without atomics, and kernels
# chosen without timing them (no autotuning). XLA reads XLA_FLAGS once, as JAX starts its
# backend; CPUs and TPUs are deterministic without it (it is ignored there).
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"


def make_deterministic() -> None:
  """Set what a reproducible run (RLConfig.deterministic) needs of this process and of the
  processes it starts, for the rest of its life: XLA's deterministic GPU operations
  (XLA_FLAGS) and deterministic batching in the rollout servers it launches (rollouts.server,
  LONGRL_DETERMINISTIC=1). experiments/run.py calls it before JAX starts; in a notebook, call
  it before the first JAX computation. ConfigError when JAX already runs on a GPU without the
  flag (restart, and call it first or set XLA_FLAGS before importing jax)."""
  from jax._src import xla_bridge  # no public API says whether the backend has started
  flags = os.environ.get("XLA_FLAGS", "")
  if DETERMINISTIC_XLA_FLAG not in flags.split():
    if xla_bridge.backends_are_initialized() and jax.default_backend() == "gpu":
      raise ConfigError(
          f"RLConfig.deterministic: JAX started its GPU backend without {DETERMINISTIC_XLA_FLAG} "
          "in XLA_FLAGS, and XLA reads its flags only then; set os.environ['XLA_FLAGS'] (or "
          "call rl.trainer.make_deterministic()) before importing jax, or run "
          "experiments/run.py, which sets it")
    os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_XLA_FLAG}".strip()  # and for children
  os.environ[DETERMINISTIC_ENV] = "1"


def train(run_dir: str, *, task, model: Callable[[int], ModelConfig], tokenizer=None,
          rl: RLConfig = RLConfig(), objective: Objective = Objective(),
          rollouts: Optional[sources.Source] = None,
          start: Optional[Start] = None, engine: Optional[EngineFactory] = None,
          mesh: Optional[Mesh] = None, hooks: Hooks = Hooks(), seed: int = 0
          ) -> dict[str, Any]:
  """A whole run in `run_dir` (see `build` for the arguments): the start, held-out
  evaluation, rl.num_steps RL steps through the hooks, evaluation. Running it again on the
  same directory resumes from the last checkpoint (the step count goes on, metrics.jsonl is
  appended). Returns the summary: {"sft_accuracy", "rl_accuracy", "steps", ...}, the held-out
  greedy evaluation after the start and after RL (for an agentic task with its episode
  metrics: sft_tool_calls_rate, rl_turns, ...)."""
  run = build(run_dir, task=task, model=model, tokenizer=tokenizer, rl=rl, objective=objective,
              rollouts=rollouts, start=start, engine=engine, mesh=mesh, hooks=hooks, seed=seed)
  try:
    hooks_lib.drive(run)
  finally:  # servers end with the run, checkpoints are written, also on failure
    run.close()
  return run.summary


def build(run_dir: str, *, task, model: Callable[[int], ModelConfig], tokenizer=None,
          rl: RLConfig = RLConfig(), objective: Objective = Objective(),
          rollouts: Optional[sources.Source] = None,
          start: Optional[Start] = None, engine: Optional[EngineFactory] = None,
          mesh: Optional[Mesh] = None, hooks: Hooks = Hooks(), seed: int = 0) -> Run:
  """A run's parts, from `run_dir`'s last checkpoint when it has one.

  `model` is called with the tokenizer's vocabulary size (e.g. models.config.tiny), or is a
  pretrained checkpoint (rl.pretrained.HFCheckpoint), which then also gives the tokenizer
  (its chat format) and the start (its params, no SFT warm start). `tokenizer` defaults to
  CharTokenizer. `rl`: the sizes; `objective`: what a step optimizes; `rollouts`: the
  rollout source (rl/sources.py; default Lockstep()); `start`: where the params start
  (WarmStart, FromRun or an HFCheckpoint; default WarmStart(), or the model's checkpoint),
  which is also the reference policy of a KL (kept in run_dir/sft, or the checkpoint
  directory itself). `engine(cfg, params, version)` makes the rollout engine (default: the
  embedded JaxEngine; rollouts.sglang_engine.local_engine serves the policy from subprocesses over
  SGLang's protocol, its remote_engine uses SGLang servers). `mesh`
  (models.sharding.make_mesh) is where the SFT and RL train steps and the reference
  log-probs run; its `context` axis turns on ring attention. `hooks`: rl.trainer.Hooks.
  Several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set, or
  models.distributed.initialize called first; every process calls it with the same
  arguments): `mesh` spans all their devices, each process makes its own shards of the
  params, optimizer state and batches and generates for its share of each step's prompts
  on its own embedded engine (an engine that serves every process, servers, is made and
  driven by process 0 alone), process 0 alone writes metrics, summary, plots and logs, and
  all take part in every checkpoint. A run resumes on another number of processes when its
  mesh fits them (the state is resharded on restore).
  A reproducible run: RLConfig.deterministic.
  Everything that can be wrong with the configuration raises ConfigError before anything is
  compiled or written.
  """
  if rl.deterministic:
    make_deterministic()
  distributed.initialize()  # several processes when the environment says so (JAX_* variables)
  pretrained = model if isinstance(model, HFCheckpoint) else None
  if pretrained is not None:
    pretrained.check()
  tokenizer = tokenizer or (pretrained.tokenizer() if pretrained else CharTokenizer())
  start = start or pretrained or WarmStart()
  rollouts = sources.Lockstep() if rollouts is None else rollouts
  plan = _plan(task=task, model=model, tokenizer=tokenizer, rl=rl, objective=objective,
               start=start, mesh=mesh, hooks=hooks)
  factory = engine or embedded_engine
  # Before anything is built, with what the factory says its engine can do; again once made.
  sources.check(rollouts, sources.Context(None, task, tokenizer, rl, plan.sampler,
                                          getattr(factory, "capabilities", None)))
  cfg, tokenizer = plan.cfg, plan.tokenizer
  # Nothing is loaded, started or written before process 0 holds the directory; it lets go last.
  held = distributed.checked(lambda: run_lock.hold(run_dir) if distributed.is_primary() else None)
  cleanup = contextlib.ExitStack()  # the Run's, once it is made
  if held is not None:
    cleanup.callback(held.release)
  try:
    # Teachers load before the warm start: a wrong path or shape fails before anything trains.
    teachers = None if objective.teachers is None else objective.teachers(cfg)
    if teachers is not None:
      cleanup.callback(teachers.close)
    say = print if distributed.is_primary() else lambda *args, **kwargs: None
    say(f"train step: mesh {'one device' if mesh is None else dict(mesh.shape)}, attention "
        f"{plan.kernel}" + (f", {jax.process_count()} processes"
                               if jax.process_count() > 1 else ""))
    optimizer = loop.rl_optimizer(rl.learning_rate,
                                  frozen=("visual",) if rl.freeze_vision else ())
    # A pretrained model's params are where any start begins (a WarmStart fine-tunes them).
    params, place = _initial_params(pretrained or start, cfg, mesh, seed, optimizer)
    rollout_engine = _make_engine(factory, cfg, params, 0)
    if rollout_engine is not None:
      cleanup.callback(rollout_engine.close)
    context = sources.Context(rollout_engine, task, tokenizer, rl, plan.sampler)
    distributed.checked(lambda: sources.check(rollouts, context))
    run = _start(run_dir, context, rollouts, plan, params, place, optimizer, cleanup,
                 start=start, mesh=mesh, hooks=hooks, seed=seed)
    run.parts = _parts(run, plan, start, optimizer, mesh, teachers)
    run.evaluation_engine = _evaluation_engine(run, hooks.evaluation)
  except BaseException:
    cleanup.close()
    raise
  run.hooks = hooks_lib.standard(run, hooks, seed, pretrained and pretrained.export, (
      start is pretrained or None) and pretrained.path) + list(hooks.extra)
  return run


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the configuration resolves to, once checked."""
  cfg: ModelConfig
  tokenizer: Any  # a vision-language model's: WithImages
  kernel: str  # the attention kernel, in words
  loss: losses.BoundLoss
  advantage: str
  correction: corrections_lib.Correction
  reward: rewards_lib.RewardTransform
  sampler: sampling_lib.SamplingTransform
  objective: Objective


def _plan(*, task, model, tokenizer, rl: RLConfig, objective: Objective, start, mesh,
          hooks: Hooks) -> _Plan:
  """Every check that needs nothing built, and what they resolve."""
  rl.check()
  start.check(tokenizer, jax.process_count())
  monitors = hooks.monitors
  known = set(monitors) if monitors is not None else set(monitors_lib.defaults())
  unknown = sorted(set(hooks.stop_on) - known)
  if unknown:
    raise ConfigError(f"Hooks.stop_on names {unknown}, which are not among the run's monitors "
                      f"{sorted(known)} (Hooks.monitors)")
  for name in ("samples", "samples_every"):
    if getattr(hooks, name) < 0:
      raise ConfigError(f"Hooks.{name}={getattr(hooks, name)}: must be >= 0 (0: none)")
  if hooks.checkpoint_every < 1:
    raise ConfigError(f"Hooks.checkpoint_every={hooks.checkpoint_every}: must be >= 1 (the "
                      "last step is always checkpointed too)")
  if hooks.wandb_project and importlib.util.find_spec("wandb") is None:
    raise ConfigError("Hooks.wandb_project needs the wandb package: pip install "
                      "'longrl[wandb]'")
  loss = losses.bind(objective.loss, dict(objective.loss_hparams or {}))
  if losses.get(objective.loss).advantage is None:
    raise ConfigError(f"loss {objective.loss!r} does not train on rollouts (e.g. DPO trains on "
                      f"preference pairs: rl.long2short.dpo); RL losses: "
                      f"{', '.join(losses.rollout_losses())}")
  correction = objective.correction or corrections_lib.keep()
  reads = loss.reads | correction.reads
  if ("teacher_logp" in reads) != (objective.teachers is not None):
    raise ConfigError(f"loss {objective.loss!r} reads teacher log-probs: set "
                      "Objective.teachers (e.g. @from_checkpoints)" if objective.teachers is None
                      else f"Objective.teachers is set, but loss {objective.loss!r} reads no "
                      "teacher log-probs; use loss 'opd' or drop the teachers")
  advantage = objective.advantage or losses.get(objective.loss).advantage
  if advantage not in advantages_lib.ESTIMATORS:
    raise ConfigError(f"unknown advantage estimator {advantage!r}; valid: "
                      f"{', '.join(sorted(advantages_lib.ESTIMATORS))}")
  if objective.kl_reward is not None:
    objective.kl_reward.check()
  cfg = model(tokenizer.vocab_size)
  if objective.routing_replay and cfg.moe is None:
    raise ConfigError(f"Objective.routing_replay is for a mixture of experts; the model "
                      f"({cfg.family}) is dense")
  if objective.expert_bias_rate and (cfg.moe is None or not cfg.moe.correction_bias):
    raise ConfigError(f"Objective.expert_bias_rate={objective.expert_bias_rate} moves a "
                      "mixture's correction bias (DeepSeek-V3's router); the model has none")
  if objective.expert_balance_coef and cfg.moe is None:
    raise ConfigError(f"Objective.expert_balance_coef={objective.expert_balance_coef} weighs "
                      f"a mixture's load-balancing loss; the model ({cfg.family}) is dense")
  if rl.lora is not None:
    _check_lora(rl, cfg, objective, mesh)
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                      f"{tokenizer.vocab_size}")
  tokenizer = _with_images(tokenizer, cfg, rl)
  context = 1 if mesh is None else mesh.shape["context"]
  try:
    kernel = dispatch.plan(cfg.attention, context, cfg.compute_dtype)
  except dispatch.KernelUnavailable as e:
    raise ConfigError(str(e)) from None
  _check_room(task, tokenizer, rl)
  if rl.prompts_per_step > len(task.train):
    raise ConfigError(f"RLConfig.prompts_per_step={rl.prompts_per_step} exceeds the "
                      f"{len(task.train)} training prompts")
  if hooks.evaluation.records > len(task.test):
    raise ConfigError(f"Evaluation.records={hooks.evaluation.records} exceeds the "
                      f"{len(task.test)} test records")
  if jax.process_count() > 1:
    _check_processes(mesh, objective)
  if kernel.startswith("ring/"):
    kernel = f"ring over {context} sequence shards, {kernel.removeprefix('ring/')} chunks"
  return _Plan(cfg, tokenizer, kernel,
               loss, advantage, correction,
               objective.reward or rewards_lib.named_chain(
                   {"correctness": rewards_lib.correctness()}),
               objective.sampler or sampling_lib.uniform(), objective)


# A completion shorter than this is no chain of thought: a row leaving less is a mistake.
_MIN_ROOM = 16


def _with_images(tokenizer, cfg: ModelConfig, rl: RLConfig):
  """A vision-language model's tokenizer: `tokenizer` with the model's VisionConfig
  (WithImages), once its image placeholder is the model's image tokens; a text model's as
  it is. ConfigError for freeze_vision without a tower."""
  if cfg.vision is None:
    if rl.freeze_vision:
      raise ConfigError(f"RLConfig.freeze_vision: the model ({cfg.family}) has no vision tower")
    return tokenizer
  v = cfg.vision
  raw = getattr(tokenizer, "tokenizer", tokenizer)  # a chat template's would wrap the text
  try:
    placeholder = raw.encode(vision.PLACEHOLDER)
  except ValueError as e:
    placeholder = str(e)
  want = [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
  if placeholder != want:
    raise ConfigError(f"the tokenizer encodes the image placeholder {vision.PLACEHOLDER!r} as "
                      f"{placeholder}, the model's image tokens are {want}: a vision-language "
                      "model needs a tokenizer with them (CharTokenizer(extra_specials="
                      "VISION_SPECIALS) for models.config.tiny_vision's ids)")
  return WithImages(tokenizer, v)


def _check_room(task, tokenizer, rl: RLConfig, sample: int = 64) -> None:
  """ConfigError when the first `sample` training prompts leave a packed row of seq_len
  tokens too little room for a completion (a chat template and system prompt can take
  hundreds of tokens); each completion would end after a few tokens, truncated."""
  count = min(sample, len(task.train))
  try:
    longest = max(len(rollout.prompt_ids(task, tokenizer, task.train[i]))
                  for i in range(count))
  except ValueError as e:  # e.g. images for a text model
    raise ConfigError(f"the task's prompts: {e}") from None
  room = rl.seq_len + 1 - longest
  if room < min(rl.max_new_tokens, _MIN_ROOM):
    raise ConfigError(f"a training prompt has {longest} tokens (under the chat template, if "
                      f"any): a row of RLConfig.seq_len={rl.seq_len} leaves {max(room, 0)} for "
                      f"its completion (max_new_tokens={rl.max_new_tokens}); raise seq_len to "
                      f"at least {longest + rl.max_new_tokens - 1} or shorten the prompt")


def _check_lora(rl: RLConfig, cfg: ModelConfig, objective: Objective,
                mesh: Optional[Mesh]) -> None:
  """ConfigError for what a LoRA run cannot do (yet)."""
  if mesh is not None:
    raise ConfigError("RLConfig.lora: LoRA runs on one device for now (train.mesh unset); "
                      f"got a mesh of {dict(mesh.shape)}")
  if objective.expert_bias_rate:
    raise ConfigError(f"Objective.expert_bias_rate={objective.expert_bias_rate} moves the "
                      "router's correction bias, which a LoRA run keeps frozen in its base")

  def adapters():
    key = jax.random.PRNGKey(0)
    return lora_lib.init_adapters(transformer.init_params(cfg, key), rl.lora, cfg, key)

  try:  # shapes only: nothing is compiled or computed
    jax.eval_shape(adapters)
  except ValueError as e:
    raise ConfigError(f"RLConfig.lora: {e}") from None


def _check_processes(mesh: Optional[Mesh], objective: Objective) -> None:
  """ConfigError for what a run on several JAX processes cannot do (yet): the mesh must span
  every process's devices, and rollouts are whole steps, without teachers (the start checks
  its own)."""
  count = jax.process_count()
  if mesh is None or mesh.devices.size != jax.device_count():
    raise ConfigError(f"{count} JAX processes with {jax.device_count()} devices in all: "
                      "train.mesh must span them all (e.g. make_mesh.fsdp = "
                      f"{jax.device_count()}), got {None if mesh is None else dict(mesh.shape)}")
  if objective.teachers is not None:
    raise ConfigError(f"Objective.teachers: not supported with {count} JAX processes yet "
                      "(several processes generate whole steps)")


def _initial_params(start: Start, cfg: ModelConfig, mesh: Optional[Mesh], seed: int,
                    optimizer):
  """The start's initial params (random, or a checkpoint's; on a mesh each process holds
  only its own shards), and `place(TrainState)`: the state sharded over the mesh (params and
  optimizer moments split over fsdp and tensor)."""
  params = start.initial(cfg, mesh, seed)
  if mesh is None:
    return params, lambda train: train
  sharding.check_sharded(params, mesh)
  shardings = sharding.state_shardings(init_train_state(params, optimizer), optimizer, mesh)
  return params, lambda train: jax.device_put(distributed.replicated(train, mesh), shardings)


def _make_engine(factory: EngineFactory, cfg: ModelConfig, params, version: int):
  """The engine `factory` makes. Process 0 makes one first; when it does not serve every
  process (an embedded one), each other process makes its own, else they have none."""
  whole = distributed.local_copy(params)
  primary = distributed.is_primary()
  first = distributed.checked(lambda: factory(cfg, whole, version) if primary else None)
  serves_all = distributed.gather(
      first.capabilities.serves_all_processes if primary else None)[0]
  if primary or serves_all:
    return first
  return factory(cfg, whole, version)


def _start(run_dir: str, context: sources.Context, rollouts, plan: _Plan, params, place,
           optimizer, cleanup: contextlib.ExitStack, *, start: Start, mesh, hooks: Hooks,
           seed: int) -> Run:
  """The run at its first step: resumed from the last checkpoint, or from `start` (the
  starting params kept as the reference and given to the engine); what it opens goes on
  `cleanup`, which the Run takes."""
  os.makedirs(run_dir, exist_ok=True)
  checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
  cleanup.callback(checkpointer.close)
  lora_cfg = context.config.lora
  parts = loop.Parts(context, rollouts, plan.loss, None, plan.reward, plan.advantage)
  # A LoRA run's train state holds its adapters: fresh ones (they depend on the params'
  # shapes alone), or the shape a resumed run's restore into.
  trained = params if lora_cfg is None else lora_lib.init_adapters(
      params, lora_cfg, plan.cfg, jax.random.PRNGKey(seed + 2))
  state = loop.init_state(trained, optimizer, parts, seed + 1)
  state = state.replace(train=place(state.train))
  summary_path = os.path.join(run_dir, "summary.json")
  summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
  resumed = checkpointer.latest_step() is not None
  say = print if distributed.is_primary() else lambda *args, **kwargs: None
  if resumed:
    state = checkpointer.restore(state)
    say(f"resuming from {run_dir} at RL step {int(state.step)}")
    if distributed.is_primary():
      for name in ("metrics.jsonl", samples_lib.FILE):
        moved = metrics_lib.truncate(os.path.join(run_dir, name), int(state.step))
        if moved:
          say(f"{moved} records of {name} after the checkpoint moved to {name}.discarded")
    summary.pop("stopped", None)
    if lora_cfg is not None:  # the base: the starting params the fresh run kept
      parts = dataclasses.replace(parts, base=start.reference(run_dir, params))
  else:
    started = time.perf_counter()
    params, summary = start.params(params, plan.cfg, context.task, context.tokenizer,
                                   seq_len=context.config.seq_len, seed=seed,
                                   progress=hooks.progress and distributed.is_primary(),
                                   mesh=mesh)
    if summary["init_from"] is not None:
      say(f"starting from the params of {summary['init_from']} (no SFT warm start)")
    summary["sft_seconds"] = time.perf_counter() - started
    if lora_cfg is None:
      trained = params
    else:
      parts = dataclasses.replace(parts, base=params)
      say(f"LoRA: {lora_lib.count(trained):,} trained parameters (rank {lora_cfg.rank}, alpha "
          f"{lora_cfg.alpha:g}) over a frozen base of {lora_lib.count(params):,}")
      if lora_cfg.attention_only:
        say("warning: LoRA adapts attention alone, which underperforms in RL (LoRA Without "
            "Regret, Thinking Machines 2025); add gate_proj, up_proj and down_proj to "
            "LoraConfig.targets")
    state = state.replace(train=place(init_train_state(trained, optimizer)))
    start.keep(run_dir, params)
  # The engine was made with the random params (a LoRA run's: adapters and base, on servers).
  loop.sync_engine(parts, state.train.params, int(state.step))
  objective = plan.objective
  loggers = loggers_lib.Loggers(
      run_dir, tensorboard=hooks.tensorboard and distributed.is_primary(),
      wandb_project=hooks.wandb_project if distributed.is_primary() else None,
      resume_step=int(state.step) if resumed else None,
      config={"loss": objective.loss, "loss_hparams": objective.loss_hparams,
              "advantage": plan.advantage, "rl": dataclasses.asdict(context.config),
              "seed": seed, "start": repr(start), "rollouts": repr(rollouts)})
  cleanup.callback(loggers.close)
  return Run(run_dir, plan.cfg, context.task, context.tokenizer, context.config, parts,
             state, checkpointer, loggers, summary, resumed, hooks.evaluation.records,
             cleanup=cleanup, label=f"{objective.loss} on {type(context.task).__name__}",
             samples=hooks.samples)


def _parts(run: Run, plan: _Plan, start: Start, optimizer, mesh: Optional[Mesh],
           teachers) -> loop.Parts:
  """The loop's parts: the jitted train step (donating, on the mesh), the reference policy
  (the starting params, from the start; a LoRA run's base, no copy) when the loss or the
  reward reads it, and the trainer's log-probs (for the correction, and for the mismatch
  every step logs)."""
  cfg, loss, objective = run.cfg, plan.loss, plan.objective
  place_rows = (lambda batch: batch) if mesh is None else (
      lambda batch: sharding.place_rows(batch, mesh))
  state_shardings = None if mesh is None else sharding.state_shardings(
      run.state.train, optimizer, mesh)
  logprobs_fn = sharding.on_mesh(mesh, _POLICY_LOGPROBS)
  replay = objective.routing_replay
  kl_reward = objective.kl_reward if objective.kl_reward and objective.kl_reward.coef else None
  reference = reference_logprobs = None
  base = run.parts.base
  if "ref_logp" in loss.reads or kl_reward is not None:
    reference = base if base is not None else start.reference(run.run_dir,
                                                               run.state.train.params)
    # Params go in as an argument: closing over them would bake them into the executable.
    reference_logprobs = lambda batch: distributed.host_copy(
        logprobs_fn(reference, cfg, place_rows(batch))[0])
  step_fn = _train_step(cfg, optimizer, loss, run.config.micro_batches, mesh,
                        state_shardings, replay, (objective.expert_bias_rate,
                                                  objective.expert_balance_coef))
  return dataclasses.replace(
      run.parts,
      train_step=lambda train, batch, ref: step_fn(train, place_rows(batch), ref, base),
      correction=plan.correction,
      trainer_logprobs=lambda params, batch: distributed.host_copy(logprobs_fn(
          loop.policy(run.parts, params), cfg, place_rows(batch), replay=replay)[0]),
      kl_reward=kl_reward, reference_logprobs=reference_logprobs,
      ref_params=reference if "ref_logp" in loss.reads else None, teachers=teachers)


# Jitted once per process: runs built one after another (a notebook, findings' tiny runs in one
# process) reuse the compiled programs instead of tracing them again.
_POLICY_LOGPROBS = jax.jit(policy_logprobs, static_argnums=1, static_argnames="replay")
_TRAIN_STEPS: dict[tuple, Callable] = {}


def _train_step(cfg: ModelConfig, optimizer, loss: losses.BoundLoss, micro_batches: int,
                mesh: Optional[Mesh], state_shardings, replay: bool,
                balancing: tuple[float, float]) -> Callable:
  """The jitted train step (routing replay, and `balancing` = (expert_bias_rate,
  balance_coef), as make_train_step's), donating its state: one copy of the params and
  moments less at each update's peak (nothing reads a state after its update; an orbax save
  still reading one keeps it: JAX then copies instead of donating). Without a mesh, one per
  (model config, optimizer, loss, micro-batches, replay, balancing) in this process."""
  make = lambda: sharding.on_mesh(mesh, make_train_step(
      cfg, optimizer, loss, micro_batches=micro_batches, state_shardings=state_shardings,
      donate_state=True, replay=replay, expert_bias_rate=balancing[0],
      balance_coef=balancing[1]))
  if mesh is not None:
    return make()
  key = (cfg, optimizer, loss.name, repr(sorted(loss.hparams.items())), micro_batches, replay,
         balancing)
  if key not in _TRAIN_STEPS:
    _TRAIN_STEPS[key] = make()
  return _TRAIN_STEPS[key]


def _evaluation_engine(run: Run, evaluation: Evaluation):
  """The rollout engine when it holds the current weights at every evaluation
  (weight_sync_every 1), else one of its own."""
  engine = run.parts.context.engine
  if run.config.weight_sync_every == 1:
    return engine
  own = _make_engine(evaluation.engine or embedded_engine, run.cfg,
                     loop.plain_policy(run.parts, run.state.train.params), int(run.state.step))
  if own is not None:
    run.cleanup.callback(own.close)
  return own
