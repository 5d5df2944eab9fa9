"""Hooks: what a run does around its steps, as Levanter's trainer hooks do.

A hook is a small object with `every` and any of `start(run)` (once, before the first step),
`step(run, record)` (after every `every`-th step; 0: never) and `end(run)` (once, after the
last step, unless the run failed). `drive` runs a built run (rl.run.Run) through its hooks:
the loop's generator is drained step by step and each record goes through the hooks in order,
so a hook sees what the ones before it added (the evaluation's eval_* metrics reach the
monitors, the monitors' warnings reach metrics.jsonl). `standard` gives the hooks every run
has, from rl.trainer.Hooks; a notebook or a gin binding (Hooks.extra) adds its own.

Owns the evaluation schedule, the collapse monitors' warnings and stops (rl/monitors.py),
writing each step's record (metrics.jsonl, TensorBoard, W&B: rl/loggers.py) and, every few
steps, samples of its trajectories (samples.jsonl and the loggers' tables: rl/samples.py;
each evaluation writes its own), the progress bar, checkpoints, and the summary, plot and
last lines at the end.
"""

import os
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from models import distributed, hf_lora
from rl import loop
from rl import metrics as metrics_lib
from rl import monitors as monitors_lib
from rl.trajectory import column


class Hook:
  """Does nothing; subclasses override what they need."""
  every = 1

  def start(self, run) -> None:
    pass

  def step(self, run, record) -> None:
    pass

  def end(self, run) -> None:
    pass


def drive(run) -> None:
  """Run `run` to RLConfig.num_steps (or until a hook stops it) through its hooks."""
  for hook in run.hooks:
    hook.start(run)
  steps = run.steps()
  try:
    for _ in range(max(0, run.config.num_steps - int(run.state.step))):
      record = next(steps)
      for hook in run.hooks:
        if hook.every and record.step % hook.every == 0:
          hook.step(run, record)
      if run.stopped:
        break
  finally:
    steps.close()  # a source running ahead stops
  for hook in run.hooks:
    hook.end(run)


def prefixed(prefix: str, held_out: dict) -> dict:
  return {f"{prefix}_{key}": value for key, value in held_out.items()}


def held_out_text(held_out: dict) -> str:
  """One greedy_eval result in words."""
  text = f"accuracy {held_out['accuracy']:.3f}, mean length {held_out['length']:.1f}"
  if "tool_calls_rate" in held_out:
    text += (f", tool calls in {held_out['tool_calls_rate']:.2f} of the episodes, "
             f"{held_out['turns']:.2f} turns each")
  return text


class Evaluate(Hook):
  """Held-out greedy evaluation after the start (step 0, into metrics.jsonl and summary.json as
  sft_*), every `evaluation.every` steps (eval_* in the step's record, and the sampled
  evaluation's pass@k / maj@k / mean@k at its largest budget) and after the last step
  (summary.json's rl_*). Each writes its samples (Run.write_samples): split "eval", the last
  one's "final"."""

  def __init__(self, evaluation, seed: int):
    self.evaluation, self.seed = evaluation, seed
    self.every = evaluation.every

  def start(self, run) -> None:
    if run.resumed:
      return
    held_out = run.evaluate(0)
    run.summary = {**prefixed("sft", held_out), **run.summary}
    run.write_summary()
    run.write({"step": 0, **prefixed("eval", held_out)})
    run.say(f"{'at the start' if run.summary.get('init_from') else 'after SFT'}: held-out "
            f"{held_out_text(held_out)}")

  def step(self, run, record) -> None:
    record.metrics.update(prefixed("eval", run.evaluate(record.step)))
    if self.evaluation.sampled is not None:
      report = run.sampled_eval(record.step, self.evaluation.sampled, self.seed + record.step)
      # Its sampled "accuracy" is mean@n: kept apart from the greedy eval_accuracy.
      record.metrics.update({f"eval_{key}": value for key, value in
                             report["budgets"][max(report["budgets"])].items()
                             if key != "accuracy"})

  def end(self, run) -> None:
    run.summary.update(prefixed("rl", run.evaluate(int(run.state.step), "final")),
                       steps=int(run.state.step))


class Monitors(Hook):
  """Every step's metrics through the collapse monitors: an alert is printed above the
  progress bar and recorded in the step's `warnings`; one named in `stop_on` ends the run
  (its checkpoint is saved, summary.json's "stopped" says which monitor saw what). The
  monitors' state is replayed from metrics.jsonl at the start, so a resumed run's monitor
  that fired stays quiet until its rule clears."""

  def __init__(self, monitors, stop_on):
    self.monitor = monitors_lib.named_chain(monitors)
    self.stop_on = set(stop_on)

  def start(self, run) -> None:
    self.state = self.monitor.init()
    # Every process reads process 0's records: all replay the same monitor state.
    history = distributed.gather(metrics_lib.read(run.metrics_path) if run.primary
                                 else None)[0]
    for past in history:  # the monitors' state is a function of the records so far
      _, self.state = self.monitor.update(past, self.state)

  def step(self, run, record) -> None:
    alerts, self.state = self.monitor.update(record.metrics, self.state)
    for alert in alerts:
      if run.primary:
        tqdm.write(f"warning [{alert.monitor}] at RL step {record.step}: {alert.message}")
    if alerts:
      record.metrics["warnings"] = [alert._asdict() for alert in alerts]
    stops = [alert for alert in alerts if alert.monitor in self.stop_on]
    if stops:
      run.stopped = {"step": record.step, **stops[0]._asdict()}

  def end(self, run) -> None:
    if run.stopped:
      run.summary["stopped"] = run.stopped


class Record(Hook):
  """Each step's record into metrics.jsonl (process 0) and the loggers, with histograms of
  its advantages and completion lengths."""

  def step(self, run, record) -> None:
    run.write(record.metrics, {
        "distribution/advantages": record.advantages,
        "distribution/completion_length": column(record.trajectories, "policy_count",
                                                 np.int32)})


class Samples(Hook):
  """Every `every` steps (Hooks.samples_every), samples of the step's trajectories with their
  rewards and advantages (Run.write_samples, split "train")."""

  def __init__(self, every: int):
    self.every = every

  def step(self, run, record) -> None:
    run.write_samples(record.step, "train", record.trajectories, record.rewards,
                      record.advantages)


class Checkpoint(Hook):
  """The loop state after the start, every `every` steps, at the last step and at a stop."""

  def __init__(self, every: int):
    self.checkpoint_every = every

  def start(self, run) -> None:
    if not run.resumed:
      run.checkpointer.save(0, run.state)

  def step(self, run, record) -> None:
    if (run.stopped or record.step % self.checkpoint_every == 0
        or record.step == run.config.num_steps):
      run.checkpointer.save(record.step, record.state)


class Progress(Hook):
  """A progress bar with the step's reward, accuracy, mean length and timings."""

  def __init__(self, enabled: bool):
    self.enabled = enabled

  def start(self, run) -> None:
    self.bar = tqdm(total=run.config.num_steps, initial=int(run.state.step),
                    desc=f"RL ({run.parts.loss.name})",
                    disable=not (self.enabled and run.primary), dynamic_ncols=True)

  def step(self, run, record) -> None:
    m = record.metrics
    self.bar.set_postfix(reward=f"{m['reward']:.2f}", acc=f"{m['accuracy']:.2f}",
                         len=f"{m['completion_length']:.1f}", gen=f"{m['generate_s']:.1f}s",
                         train=f"{m['train_s']:.1f}s", idle=f"{m['trainer_idle_s']:.1f}s")
    self.bar.update(1)

  def end(self, run) -> None:
    self.bar.close()


class Summary(Hook):
  """At the end: summary.json, metrics.png, and the last lines: the held-out evaluation and
  `sft_accuracy=... rl_accuracy=...` (for an agentic task with its tool-call rates, for a
  Mixture with each task's accuracy_<domain>)."""
  every = 0

  def end(self, run) -> None:
    if run.stopped:
      stopped = run.stopped
      run.say(f"stopped by monitor {stopped['monitor']} at RL step {stopped['step']}: "
              f"{stopped['message']}. Its checkpoint is saved; running again on {run.run_dir} "
              "resumes (the monitor stays quiet until its rule clears)")
    run.write_summary()
    if run.primary:
      metrics_lib.plot(metrics_lib.read(run.metrics_path),
                       os.path.join(run.run_dir, "metrics.png"), title=run.label)
    final = {key[3:]: value for key, value in run.summary.items() if key.startswith("rl_")}
    run.say(f"after RL: held-out {held_out_text(final)}")
    summary = run.summary
    last = ["accuracy"] + (["tool_calls_rate"] if "rl_tool_calls_rate" in summary else []) + [
        key[3:] for key in summary if key.startswith("rl_accuracy_")]  # a Mixture's tasks
    run.say(" ".join(f"{prefix}_{key}={summary.get(f'{prefix}_{key}', float('nan')):.2f}"
                     for key in last for prefix in ("sft", "rl")))


class Export(Hook):
  """At the end: the final params as a Hugging Face directory, run_dir/hf, written by
  `export(params, cfg, out_dir)` (rl.pretrained.HFCheckpoint.export: weights, config.json
  and the starting checkpoint's tokenizer files). A LoRA run's are its merged weights, and its
  adapters are also written as a PEFT directory, run_dir/hf_adapter (models/hf_lora.py), over
  `base` (the starting checkpoint's path), or over its warm start's params, exported to
  run_dir/hf_base, when those are the base."""
  every = 0

  def __init__(self, export, base: str | None = None):
    self.export, self.base = export, base

  def end(self, run) -> None:
    # Every process gathers; only the first writes.
    params = distributed.local_copy(loop.plain_policy(run.parts, run.state.train.params))
    if run.primary:
      path = self.export(params, run.cfg, os.path.join(run.run_dir, "hf"))
      run.say(f"final params exported to {path} (a Hugging Face checkpoint directory)")
    if run.parts.base is None:
      return
    base = self.base
    if base is None:
      base_params = distributed.local_copy(run.parts.base)
      if run.primary:
        base = self.export(base_params, run.cfg, os.path.join(run.run_dir, "hf_base"))
    adapters = distributed.local_copy(run.state.train.params)
    if run.primary:
      path = hf_lora.save_adapter(adapters, run.cfg, run.parts.context.config.lora,
                                  os.path.join(run.run_dir, "hf_adapter"), base=base)
      run.say(f"LoRA adapters exported to {path} (a PEFT directory over {base})")


def standard(run, hooks, seed: int, export=None, base: str | None = None) -> list[Any]:
  """The hooks every run has, in their order, from rl.trainer.Hooks `hooks`; `export`: the
  Export hook's function, for a run from a pretrained checkpoint; `base`: that checkpoint's
  path when it is also a LoRA run's base."""
  monitors = monitors_lib.defaults() if hooks.monitors is None else dict(hooks.monitors)
  return [Evaluate(hooks.evaluation, seed), Monitors(monitors, hooks.stop_on), Record(),
          Samples(hooks.samples_every), Checkpoint(hooks.checkpoint_every),
          Progress(hooks.progress), *([Export(export, base)] if export else []), Summary()]
