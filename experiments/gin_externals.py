"""Registers the library's configurable pieces with gin. Importing this module is what makes
names such as `train`, `Arithmetic`, `tiny`, `make_mesh`, `RLConfig`, `Objective`, `Hooks`,
`Lockstep`, `Ahead`, `tis`, `rewards.k15_length_penalty`, `sampling.prioritized` or
`monitors.entropy_collapse` usable in .gin files; models/ and rl/ never import gin themselves.
Where two pieces share a name (`named_chain`), qualify it: `rewards.named_chain`. Monitors go
in as a dict, stops by name: `Hooks.monitors = {'entropy_collapse': @entropy_collapse()}`,
`Hooks.stop_on = ['entropy_collapse']`.

A value that is itself configured takes a reference in its parent binding: the run's pieces
are `train.objective = @Objective()`, `train.start = @WarmStart()`, `train.hooks = @Hooks()`,
`Hooks.evaluation = @Evaluation()`, `train.rollouts = @Ahead()` (a binding of `Objective.loss`
configures the Objective that `train.objective` references; without that reference `train`
uses the defaults)."""

import gin
import optax

from models import config
from models import distributed
from models import lora
from models import sharding
from models import tokenizer
from experiments import evaluation
from rl import config as rl_config
from rl import corrections
from rl import distill
from rl import effort
from rl import envs
from rl import eval as eval_lib
from rl import long2short as long2short_lib
from rl import monitors
from rl import pretrained
from rl import rewards
from rl import sampling
from rl import sources
from rl import trainer
from rl.agents import rollouts as agent_rollouts
from rl.tasks import agentic
from rl.tasks import arithmetic
from rl.tasks import code as code_task
from rl.tasks import math as math_task
from rl.tasks import mixture
from rl.tasks import needle
from rl.tasks import visual
from rollouts import jax_engine
from rollouts import sglang_engine
from rollouts.server import main as server_main

train = gin.external_configurable(trainer.train, module="rl")
evaluate = gin.external_configurable(evaluation.evaluate_checkpoint, "evaluate", module="rl")
long2short = gin.external_configurable(long2short_lib.run, "long2short", module="rl")
load_model = gin.external_configurable(server_main.load_model, module="rollouts")
embedded_engine = gin.external_configurable(jax_engine.embedded_engine, module="rollouts")
local_engine = gin.external_configurable(sglang_engine.local_engine, module="rollouts")
remote_engine = gin.external_configurable(sglang_engine.remote_engine, module="rollouts")
# Several processes: `initialize.coordinator_address = 'host:port'`, `.num_processes`,
# `.process_id` (or the JAX_* environment variables), or `initialize.detect_cluster = True`
# on a TPU pod slice or under SLURM; run.py calls it before anything else.
initialize = gin.external_configurable(distributed.initialize, module="models")

def calculator_agent(base_url: str, api_key: str, record: dict) -> str:
  """experiments/agents/calculator.py's agent, imported when it runs: it needs the `openai`
  package (the test extra), which a run without agents does not."""
  from experiments.agents import calculator
  return calculator.calculator_agent(base_url, api_key, record)


_REGISTERED = {
    "rl": [rl_config.RLConfig, rl_config.KLReward, trainer.Objective, trainer.WarmStart,
           trainer.FromRun, trainer.Hooks, trainer.Evaluation, eval_lib.SampledEval,
           distill.from_checkpoints, long2short_lib.Long2ShortConfig,
           pretrained.HFCheckpoint],
    "sources": [sources.Lockstep, sources.DynamicSampling, sources.Partial, sources.Ahead,
                agent_rollouts.AgentRollouts],
    # Agents for AgentRollouts.agent, referenced without a call: `@calculator_agent`.
    "agents": [calculator_agent],
    "corrections": [corrections.keep, corrections.mask_stale, corrections.tis,
                    corrections.trust_region, corrections.seq_tis, corrections.mis,
                    corrections.icepop, corrections.geo_mask],
    "models": [config.tiny, config.tiny_vision, config.ModelConfig, config.MoeConfig,
               lora.LoraConfig,
               tokenizer.CharTokenizer, tokenizer.vision_chars, sharding.make_mesh],
    "tasks": [arithmetic.Arithmetic, mixture.Mixture, math_task.MathTask, code_task.CodeTask,
              effort.EffortTask, agentic.ToolArithmetic, needle.Needle,
              visual.Rendered, visual.Scenes, visual.Charts],
    "envs": list(envs.ENVIRONMENTS.values()),  # every registered environment
    "effort": [effort.level_ids],
    "rewards": [rewards.correctness, rewards.episode_reward, rewards.format_reward,
                rewards.named_chain, rewards.k15_length_penalty, rewards.truncation, rewards.laser, rewards.laser_d,
                rewards.dapo_overlong, rewards.adaptive_target_length, rewards.mask_incorrect,
                rewards.mask_long_correct, rewards.mask_over_length, rewards.masked,
                rewards.accuracy_at_least, rewards.k15, rewards.dapo, rewards.effort_budget,
                rewards.tightening],
    "sampling": [sampling.uniform, sampling.prioritized, sampling.pass_rate_band,
                 sampling.curriculum, sampling.field_difficulty, sampling.named_chain],
    "monitors": list(monitors.MONITORS.values()),
    "optax": [optax.constant_schedule, optax.linear_schedule, optax.join_schedules,
              optax.piecewise_constant_schedule],
}
for _module, _fns in _REGISTERED.items():
  for _fn in _fns:
    gin.external_configurable(_fn, module=_module)
