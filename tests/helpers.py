"""Building the loop's parts by hand, as a notebook does without rl.trainer.build: the tests
that drive rl.loop.rl_steps on an engine and params of their own."""

import contextlib

import jax
import jax.numpy as jnp
import optax

from rl import corrections, loop, losses, rewards, sampling, sources
from rl.config import RLConfig
from rl.train_step import make_train_step, policy_logprobs
from rollouts.server.http_server import serve


def parts(cfg, *, engine, task, tokenizer, config: RLConfig, loss: str = "k1.5",
          loss_hparams=None, reward=None, sampler=None, rollouts=None, correction=None,
          optimizer: optax.GradientTransformation | None = None, donate: bool = False,
          train_step=None, replay: bool = False, **extra) -> loop.Parts:
  """rl.loop.Parts of a run on `engine`: the loss `loss` bound with `loss_hparams`, its
  train step (`train_step` wraps it when given: train_step(inner); routing replay when
  `replay`, the trainer's log-probs too), correctness rewards and
  uniform sampling by default, Lockstep rollouts by default; `extra`: the other Parts fields
  (ref_params, teachers, kl_reward, ...). The trainer's log-probs are given, as rl.trainer
  gives them (for the correction, and the mismatch every step logs)."""
  bound = losses.bind(loss, loss_hparams)
  optimizer = optimizer or loop.rl_optimizer(config.learning_rate)
  step = make_train_step(cfg, optimizer, bound, micro_batches=config.micro_batches,
                         donate_state=donate, replay=replay)
  correction = correction or corrections.keep()
  if "trainer_logprobs" not in extra:
    extra["trainer_logprobs"] = jax.jit(lambda p, b: policy_logprobs(p, cfg, b,
                                                                     replay=replay)[0])
  return loop.Parts(
      sources.Context(engine, task, tokenizer, config, sampler or sampling.uniform()),
      rollouts if rollouts is not None else sources.Lockstep(), bound,
      train_step(step) if train_step is not None else step,
      reward or rewards.named_chain({"correctness": rewards.correctness()}),
      losses.get(loss).advantage, correction, **extra)


def steps(params, cfg, *, seed: int = 0, copy: bool = False, **kwargs):
  """(the generator of rl.loop.rl_steps from `params`, its parts); `copy`: the state starts
  from a copy of `params` (a donating step must not take the caller's buffers)."""
  optimizer = kwargs.pop("optimizer", None) or loop.rl_optimizer(kwargs["config"].learning_rate)
  run = parts(cfg, optimizer=optimizer, **kwargs)
  start = jax.tree.map(jnp.copy, params) if copy else params
  state = loop.init_state(start, optimizer, run, seed)
  return loop.rl_steps(state, run), run


@contextlib.contextmanager
def serving(cfg, params, **options):
  """A rollouts.server in this process (weight version "0" unless `options` say; the other
  options are serve's): (its base URL, its scheduler), stopped after."""
  server = serve(cfg, params, **{"weight_version": "0", **options})
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}", server.scheduler
  finally:
    server.shutdown()
    with server.scheduler.lock:
      server.scheduler.stopped = True
      server.scheduler.lock.notify_all()
